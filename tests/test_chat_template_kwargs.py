"""Chat-template keyword arguments (e.g. `enable_thinking`) from config reach every place that
renders a chat: workflows, prompt-length limits and SFT batches."""

from __future__ import annotations

import shutil

import reward_fns

from areal_like.api import GenerationHyperparameters
from areal_like.api.config import ModelConfig
from areal_like.data.prompt_limits import load_tokenizer
from areal_like.data.sft import build_sft_batch
from areal_like.utils.chat import render_chat
from workflows import RLVRWorkflow
from workflows.common import chat_prompt_ids

# Qwen3's switch, in miniature: an empty think block closes thinking when it is disabled
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "1 + 2 ="}]


def _tokenizer_dir(tiny_model_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tiny_model_dir, folder)
    tokenizer = load_tokenizer(ModelConfig(path=str(folder)))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_enable_thinking_from_config_reaches_every_renderer(tiny_model_dir, tmp_path):
    folder = _tokenizer_dir(tiny_model_dir, tmp_path)
    plain = load_tokenizer(ModelConfig(path=str(folder)))
    off = load_tokenizer(ModelConfig(path=str(folder),
                                     chat_template_kwargs={"enable_thinking": False}))
    assert "<think>" not in render_chat(plain, MESSAGES)
    assert render_chat(off, MESSAGES).endswith("assistant\n<think>\n\n</think>\n\n")
    assert render_chat(off, MESSAGES, enable_thinking=True) == render_chat(plain, MESSAGES)

    expected = off.encode(render_chat(off, MESSAGES), add_special_tokens=False)
    assert chat_prompt_ids(off, MESSAGES) == expected
    workflow = RLVRWorkflow(reward_fns.right_if_42, GenerationHyperparameters(), off)
    assert workflow.prompt_ids({"messages": MESSAGES}) == expected
    sft = build_sft_batch([{"messages": MESSAGES, "answer": "3"}], off)
    assert sft["input_ids"][0, :len(expected)].tolist() == expected


def test_a_workflows_enable_thinking_wins_over_the_config(tiny_model_dir, tmp_path):
    """AReaL-lite's RLVRWorkflow(..., enable_thinking=False) keeps its meaning."""
    folder = _tokenizer_dir(tiny_model_dir, tmp_path)
    plain = load_tokenizer(ModelConfig(path=str(folder)))
    workflow = RLVRWorkflow(reward_fns.right_if_42, GenerationHyperparameters(), plain,
                            enable_thinking=False)
    text = plain.decode(workflow.prompt_ids({"messages": MESSAGES}))
    assert text.endswith("<think>\n\n</think>\n\n")
