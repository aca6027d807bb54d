"""Gymnasium-style text environments (workflows/gym_env.py runs them as episodes)."""
