"""Rollout workflows: RLVR, ReMax (greedy vs sample), multi-turn, tool-using agents."""

from workflows.memory_agent import MemoryAgentWorkflow, MemoryStore, make_memory_episodes
from workflows.multi_turn import MultiTurnWorkflow
from workflows.remax import ReMaxWorkflow
from workflows.rlvr import RLVRWorkflow
from workflows.tool_agent import ToolAgentWorkflow
from workflows.tools import ToolCall, ToolRegistry, ToolResult, parse_tool_calls

__all__ = [
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
