"""What vLLM's in-place reload needs after it on a CPU server (used by every path that loads
weights into a running vLLM server: from disk, a weight file, a weight-transfer update)."""

from __future__ import annotations

import torch


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """After an in-place reload, lay a mixture of experts' weights out again for vLLM's CPU
    MoE kernel. vLLM 0.32 prepacks them (`CPUUnquantizedExperts.process_weights_after_loading`)
    at start-up only, and a reload writes the checkpoint's plain [E, 2I, H] / [E, H, I]
    tensors into the prepacked storage: the kernel then reads them in the wrong layout and
    every MoE layer computes garbage without an error. The repacked values go back into the
    parameters' own storage (what the compiled model holds)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build: its kernels read the weights as loaded
        return
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or experts._use_zentorch:
            continue
        loaded = {name: getattr(layer, name) for name in ("w13_weight", "w2_weight")}
        experts.process_weights_after_loading(layer)  # registers new, prepacked parameters
        for name, param in loaded.items():
            packed = getattr(layer, name).data
            if packed.shape != param.shape:  # vLLM padded the experts' width
                raise RuntimeError(f"{name}: prepacked {tuple(packed.shape)} != loaded "
                                   f"{tuple(param.shape)}; reloading this MoE is unsupported")
            param.data.copy_(packed)
            layer.register_parameter(name, param)
