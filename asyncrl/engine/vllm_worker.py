"""What runs inside vLLM's worker (handed to ``collective_rpc``): loading weights in place and
reading back the weights and adapters every layer computes with.

In the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) these run on the engine's one
worker directly; each takes the worker first, as ``collective_rpc`` calls it.
"""

from __future__ import annotations

import torch

HEAD_KEY = "<output layer>"
# vLLM's fused experts and the Hugging Face names of the same (experts, out, in) tensors.
_EXPERT_NAMES = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}
TIED_NAME = "model.embed_tokens.weight"


def reload(worker, items: list[tuple[str, torch.Tensor]]) -> None:
    """In vLLM's worker: load the tensors in place, then re-tie and re-pack a tied output layer."""
    worker.reload_weights(weights_iterator=iter(items))
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and getattr(model.config, "tie_word_embeddings", False):
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)


def _effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight a linear layer computes with: on vLLM's CPU build its packed copy, read back by
    multiplying the identity (exact: products with 1 and sums with 0); elsewhere the parameter."""
    linear = getattr(module, "cpu_linear", None)
    if linear is None:
        return module.weight.detach()
    weight = module.weight
    cols = (
        weight.shape[-1]
        if weight.ndim == 2 and weight.numel()
        else next(
            getattr(module, a)
            for a in ("input_size_per_partition", "input_size", "embedding_dim")
            if hasattr(module, a)
        )
    )
    dtype = getattr(module, "params_dtype", module.weight.dtype)
    with torch.no_grad():
        return linear(torch.eye(cols, dtype=dtype), module.weight, None).t().to(dtype)


def read_back(worker) -> dict[str, torch.Tensor]:
    """In vLLM's worker: every weight as it is computed with, under the Hugging Face names."""
    model = worker.model_runner.model
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params:
            continue
        for pname, param in params.items():
            full = f"{name}.{pname}" if name else pname
            head = name == "lm_head" or name.endswith(".lm_head")
            # An embedding looks its rows up in the parameter; a linear layer (the output layer
            # included) computes with what its dispatch holds.
            linear = pname == "weight" and (head or not hasattr(module, "org_vocab_size"))
            tensor = _effective_weight(module) if linear else param.detach()
            tensor = tensor.to(getattr(module, "params_dtype", tensor.dtype))
            vocab = getattr(module, "org_vocab_size", None)
            if vocab is not None and tensor.ndim == 2:
                tensor = tensor[:vocab]  # vLLM pads the vocabulary
            if head:
                out[HEAD_KEY] = tensor.contiguous()
                continue
            leaf = name.rsplit(".", 1)[-1]
            if pname in _EXPERT_NAMES:  # a mixture of experts' fused (experts, out, in) weights
                out[f"{name.removesuffix('.routed_experts')}.{_EXPERT_NAMES[pname]}"] = tensor.contiguous()
                continue
            parts = packed.get(leaf)
            sizes = getattr(module, "output_sizes", None)
            if parts and sizes and len(parts) == len(sizes):
                base = name.rsplit(".", 1)[0]
                for part, chunk in zip(parts, torch.split(tensor, list(sizes), dim=0), strict=True):
                    out[f"{base}.{part}.{pname}"] = chunk.contiguous()
            else:
                out[full] = tensor.contiguous()
    return out


def read_slots(worker, lora_id: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """In vLLM's worker: adapter ``lora_id``'s (A, B) in the slot it computes with, by the plain
    model's layer name (a fused layer split into its parts)."""
    runner = worker.model_runner
    slots = list(runner.lora_manager._adapter_manager.lora_index_to_id)
    if lora_id not in slots:
        return {}
    slot = slots.index(lora_id)
    model = runner.model
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    out = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_a_stacked"):
            continue
        base, _, leaf = name.rpartition(".")
        stacked = list(zip(module.lora_a_stacked, module.lora_b_stacked, strict=True))
        parts = packed.get(leaf, [leaf]) if len(stacked) > 1 else [leaf]
        for part, (a, b) in zip(parts, stacked, strict=True):
            layer = f"{base}.{part}" if base else part
            out[layer] = (a[slot, 0, :rank].clone(), b[slot, 0, :, :rank].clone())
    return out
