"""transformers' causal-LM loss of a Qwen3-Next without its logits (``apply_context_parallel(...,
fused_loss=True)``): ``model(..., labels=...).loss`` becomes :func:`custom_ops.linear_cross_entropy`
of the final hidden states and ``lm_head``'s weight, with transformers' ``shift_labels``,
``ignore_index`` and ``num_items_in_batch``, and the output's ``logits`` are None.

The loss runs inside a call of ``lm_head`` (its forward takes the labels), so hooks on the head,
FSDP2's that gather and free its weight among them, run around it as around the logits.
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from custom_ops import linear_cross_entropy

__all__ = ["check_fused_loss", "set_fused_loss"]


def check_fused_loss(model: nn.Module, causal_lm: type) -> None:
    """``ValueError`` unless ``model`` is a ``causal_lm`` (``Qwen3NextForCausalLM``) whose head is
    a bias-free ``nn.Linear``."""
    if not isinstance(model, causal_lm):
        raise ValueError(
            f"fused_loss=True: the loss belongs to the causal LM ({causal_lm.__name__}), got {type(model).__name__}"
        )
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"fused_loss=True: lm_head must be an nn.Linear without bias, got {head!r}")


def set_fused_loss(model: nn.Module, enabled: bool) -> None:
    """``model``'s forward and its head's computing the loss without logits (``enabled``), or their
    class's forwards again; in place."""
    for module, forward in ((model, _causal_lm_forward), (model.lm_head, _head_forward)):
        if enabled:
            module.forward = types.MethodType(forward, module)
        else:
            module.__dict__.pop("forward", None)


def _head_forward(head: nn.Linear, hidden_states: torch.Tensor, shift_labels=None, ignore_index: int = -100):
    """The head's logits, or with ``shift_labels`` the summed cross-entropy of them over the
    labelled rows (0-d)."""
    if shift_labels is None:
        return type(head).forward(head, hidden_states)
    rows = hidden_states.reshape(-1, hidden_states.shape[-1])
    return linear_cross_entropy(rows, head.weight, shift_labels.reshape(-1), ignore_index, "sum")


def _causal_lm_forward(model: nn.Module, *args, labels=None, **kwargs):
    """``Qwen3NextForCausalLM.forward`` with the loss from the hidden states: transformers' own
    forward without labels; with them the base model, then ``lm_head`` called with
    ``shift_labels`` (which the patched model's pre-hook requires beside labels), the sum divided
    by ``num_items_in_batch`` or, without it, by the number of labelled rows; ``logits`` None."""
    if labels is None:
        return type(model).forward(model, *args, **kwargs)
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.models.qwen3_next.modeling_qwen3_next import load_balancing_loss_func

    shift_labels = kwargs.pop("shift_labels")
    num_items = kwargs.pop("num_items_in_batch", None)
    ignore_index = kwargs.pop("ignore_index", -100)
    return_dict = kwargs.pop("return_dict", None)
    if kwargs.pop("logits_to_keep", 0):
        raise ValueError("logits_to_keep: the fused loss covers every position and returns no logits")
    router_logits = kwargs.pop("output_router_logits", None)
    router_logits = model.config.output_router_logits if router_logits is None else router_logits
    outputs = model.model(*args, output_router_logits=router_logits, **kwargs)
    hidden = outputs.last_hidden_state
    shift_labels = shift_labels.to(hidden.device)
    loss = model.lm_head(hidden, shift_labels, ignore_index)
    count = (shift_labels != ignore_index).sum() if num_items is None else num_items
    loss = loss / (count.to(loss.device) if torch.is_tensor(count) else count)
    aux_loss = None
    if router_logits:
        aux_loss = load_balancing_loss_func(outputs.router_logits, model.num_experts, model.num_experts_per_tok,
                                            kwargs.get("attention_mask"))  # fmt: skip
        loss = loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
    out = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None, hidden_states=outputs.hidden_states,
                                    attentions=outputs.attentions, router_logits=outputs.router_logits)  # fmt: skip
    return out.to_tuple() if return_dict is False else out
