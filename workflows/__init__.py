"""Rollout workflows: RLVR (with images too), ReMax (greedy vs sample), multi-turn,
tool-using agents, agents written for the OpenAI client, agent programs through the gateway,
Gymnasium-style text environments, `verifiers` environments."""

from typing import Any

from areal_like.lazy import LazyExports
from workflows.memory_agent import MemoryAgentWorkflow, MemoryStore, make_memory_episodes
from workflows.multi_turn import MultiTurnWorkflow
from workflows.remax import ReMaxWorkflow
from workflows.rlvr import RLVRWorkflow
from workflows.tool_agent import ToolAgentWorkflow
from workflows.tools import ToolCall, ToolRegistry, ToolResult, parse_tool_calls
from workflows.vision_rlvr import VisionRLVRWorkflow

__all__ = [
    "AgentGateway",
    "ArealOpenAI",
    "GymTextWorkflow",
    "OpenAIAgentWorkflow",
    "ProgramWorkflow",
    "MemoryAgentWorkflow",
    "MemoryStore",
    "MultiTurnWorkflow",
    "ReMaxWorkflow",
    "RLVRWorkflow",
    "ToolAgentWorkflow",
    "ToolCall",
    "ToolRegistry",
    "ToolResult",
    "VerifiersWorkflow",
    "VisionRLVRWorkflow",
    "load_verifiers_items",
    "make_memory_episodes",
    "parse_tool_calls",
]

# Imported on first use: the openai package's types take ~1.3 s to import, paid otherwise by
# every trainer, controller and reward-worker process of every run.
_LAZY = LazyExports(__name__, {"ArealOpenAI": "workflows.openai_client",
                               "OpenAIAgentWorkflow": "workflows.openai_agent",
                               "AgentGateway": "workflows.gateway",
                               "ProgramWorkflow": "workflows.program",
                               "GymTextWorkflow": "workflows.gym_env",
                               "VerifiersWorkflow": "workflows.verifiers_env",
                               "load_verifiers_items": "workflows.verifiers_env"})


def __getattr__(name: str) -> Any:
    return _LAZY.get(name)


def __dir__() -> list[str]:
    return _LAZY.dir()
