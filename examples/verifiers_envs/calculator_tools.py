"""A multi-turn, tool-using `verifiers` (v1) environment: arithmetic with a `calculate` tool.

Written as verifiers' own tool environments are (its `glossary` is the model): the tool is an
`@vf.tool` method of a `Toolset`, an MCP server verifiers starts per rollout (this file run as
`python -m calculator_tools`); the `Task` names it in `toolsets()` and its `@vf.reward` is the
rubric (the boxed answer, read with verifiers' `vf.extract_boxed_answer`, equals the value).
The model plays verifiers' `null` chat harness: within one turn it may call `calculate` any
number of times (the harness runs each call and sends the result back) until it replies in
text. The environment (`CalculatorEnv.run`) then keeps the conversation going: a reply
without a boxed answer gets a user nudge, up to `max_nudges` times.

The file is loaded as the top-level module `calculator_tools` (a taskset's `id` names an
importable module, and the tool server is started as one).
"""

from __future__ import annotations

import ast
import operator
import random

import verifiers.v1 as vf

SYSTEM = ("Use the `calculate` tool to evaluate the expression, then put only the final "
          "number in \\boxed{}.")
NUDGE = "Please give the final answer as a number in \\boxed{}."
SPLIT_SEEDS = {"train": 0, "eval": 1}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg}


def evaluate(expression: str) -> int:
    """Integer arithmetic only (+ - * // %, parentheses): the tool never runs model text."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported: {ast.unparse(node)!r}")

    return walk(ast.parse(expression.strip(), mode="eval").body)


class CalculatorToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model sees the tool as `calculate`, not `calculator_toolset_...`

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression (+ - * // % and parentheses)."""
        try:
            return str(evaluate(expression))
        except (ValueError, SyntaxError, ZeroDivisionError) as e:
            return f"error: {e}"


class CalculatorTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class CalculatorData(vf.TaskData):
    expression: str
    answer: int


class CalculatorTask(vf.Task[CalculatorData, vf.State, CalculatorTaskConfig]):
    @classmethod
    def toolsets(cls, config: CalculatorTaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        answer = vf.extract_boxed_answer(trace.last_reply, strict=True).strip()
        return float(answer == str(self.data.answer))

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalculatorConfig(vf.TasksetConfig):
    task: CalculatorTaskConfig = CalculatorTaskConfig()
    num_tasks: int = 1000
    split: str = "train"


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self) -> list[CalculatorTask]:
        if self.config.split not in SPLIT_SEEDS:
            raise ValueError(f"split={self.config.split!r}: expected one of {list(SPLIT_SEEDS)}")
        rng = random.Random(SPLIT_SEEDS[self.config.split])
        tasks = []
        for _ in range(self.config.num_tasks):
            a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(1, 99)
            expression = f"{a} * {b} {rng.choice('+-')} {c}"
            tasks.append(CalculatorTask(
                CalculatorData(prompt=f"What is {expression}?", system_prompt=SYSTEM,
                               expression=expression, answer=evaluate(expression)),
                self.config.task))
        return tasks


class CalculatorEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(
        harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=8)
    max_nudges: int = 1


class CalculatorEnv(vf.Env[CalculatorEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()  # the task's prompt opens; tool calls run inside
            for _ in range(self.config.max_nudges):
                boxed = vf.extract_boxed_answer(reply.last_reply, strict=True)
                if reply.terminated or boxed:
                    break
                reply = await chat.turn(NUDGE)


__all__ = ["CalculatorEnv", "CalculatorTaskset"]  # verifiers resolves plugins via __all__


def load_environment(split: str = "train", num_tasks: int = 1000,
                     max_nudges: int = 1) -> vf.Env:
    return CalculatorEnv(CalculatorEnvConfig(
        taskset=CalculatorConfig(id=__name__, split=split, num_tasks=num_tasks),
        max_nudges=max_nudges))


if __name__ == "__main__":  # verifiers starts the tool server as `python -m calculator_tools`
    CalculatorToolset.run()
