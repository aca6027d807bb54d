"""Rollout workflows: RLVR, ReMax (greedy vs sample), multi-turn, tool-using agents, agents
written for the OpenAI client."""

from workflows.memory_agent import MemoryAgentWorkflow, MemoryStore, make_memory_episodes
from workflows.multi_turn import MultiTurnWorkflow
from workflows.openai_agent import OpenAIAgentWorkflow
from workflows.openai_client import ArealOpenAI
from workflows.remax import ReMaxWorkflow
from workflows.rlvr import RLVRWorkflow
from workflows.tool_agent import ToolAgentWorkflow
from workflows.tools import ToolCall, ToolRegistry, ToolResult, parse_tool_calls

__all__ = [
    "ArealOpenAI",
    "OpenAIAgentWorkflow",
    "MemoryAgentWorkflow",
    "MemoryStore",
    "MultiTurnWorkflow",
    "ReMaxWorkflow",
    "RLVRWorkflow",
    "ToolAgentWorkflow",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "make_memory_episodes",
    "parse_tool_calls",
]
