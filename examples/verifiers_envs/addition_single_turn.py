"""A single-turn `verifiers` (v1) environment: "What is A + B?", answered in \\boxed{}.

Written as verifiers' own tasksets are (its `reverse_text` is the model): typed `TaskData`, a
`Task` whose `@vf.reward` is the rubric, a `Taskset` whose `load()` yields the tasks, the
environment a `SingleAgentEnv` playing the tool-less `null` chat harness. The rubric reads the
answer with verifiers' own parser, `vf.extract_boxed_answer`.

Run here through the agent gateway (workflows/verifiers_env.py):

    VerifiersWorkflow("examples/verifiers_envs/addition_single_turn.py:load_environment", ...)

The file is loaded as the top-level module `addition_single_turn`: a taskset's `id` names an
importable module (verifiers resolves tasksets by id).
"""

from __future__ import annotations

import random

import verifiers.v1 as vf

SYSTEM = "Add the two numbers. Put only the final number in \\boxed{}."
SPLIT_SEEDS = {"train": 0, "eval": 1}  # disjoint streams: eval items are never trained on


class AdditionData(vf.TaskData):
    a: int
    b: int
    answer: int
    """The sum: what the rubric compares the boxed answer with."""


class AdditionTask(vf.Task[AdditionData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        # one answer: a second model turn is refused
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        answer = vf.extract_boxed_answer(trace.last_reply, strict=True).strip()
        return float(answer == str(self.data.answer))


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    max_operand: int = 99
    split: str = "train"


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        if self.config.split not in SPLIT_SEEDS:
            raise ValueError(f"split={self.config.split!r}: expected one of {list(SPLIT_SEEDS)}")
        rng = random.Random(SPLIT_SEEDS[self.config.split])
        tasks = []
        for _ in range(self.config.num_tasks):
            a, b = rng.randint(0, self.config.max_operand), rng.randint(0, self.config.max_operand)
            tasks.append(AdditionTask(
                AdditionData(prompt=f"What is {a} + {b}?", system_prompt=SYSTEM,
                             a=a, b=b, answer=a + b),
                self.config.task))
        return tasks


__all__ = ["AdditionTaskset"]  # verifiers finds a taskset module's class through __all__


def load_environment(split: str = "train", num_tasks: int = 1000) -> vf.Env:
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
        taskset=AdditionConfig(id=__name__, split=split, num_tasks=num_tasks),
        # verifiers' tool-less chat loop, as a local process (its default runtime is remote)
        agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig()),
    ))
