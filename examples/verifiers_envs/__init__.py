"""verifiers (v1) environments (workflows/verifiers_env.py runs them as episodes); each file
is loaded as a top-level module by the verifiers runner, in the verifiers venv."""
