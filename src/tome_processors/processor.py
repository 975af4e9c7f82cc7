"""`ToMeProcessor`: merge the tokens, run the inner attention processor, unmerge its output."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from .arguments import argument
from .attach import PassedThrough, slot_for_call
from .config import ToMeConfig
from .context import SLOT_ATTR, AttentionSlot
from .families import Layout
from .joint_attention import run_with_text
from .merge import TokenMerge, pool_tokens
from .rotary_attention import run_with_rotary


class _SignedCall:
    """`processor.__call__` as diffusers inspects it: the inner processor's signature.

    `Attention.forward` keeps only the keyword arguments named in
    `inspect.signature(processor.__call__)`, so a wrapper must show its inner processor's
    parameters or IP-Adapter masks and custom keyword arguments are silently dropped.
    """

    __slots__ = ("processor", "__signature__")

    def __init__(self, processor: ToMeProcessor, signature: inspect.Signature) -> None:
        self.processor = processor
        self.__signature__ = signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.processor(*args, **kwargs)


def _inner_signature(inner: Any) -> inspect.Signature:
    try:
        return inspect.signature(inner.__call__)
    except (TypeError, ValueError):  # builtins without a signature: accept everything
        return inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )


class ToMeProcessor(torch.nn.Module):
    """An attention processor that runs its inner processor on merged tokens.

    It wraps ("chains") any diffusers attention processor (SDPA, xFormers, IP-Adapter, your own):
    on a self-attention module inside a spatial transformer block it merges the tokens (the merge
    computed once per block and forward from the raw block input, as in tomesd), calls the inner
    processor on them, and copies the output back to every token. Everything else - the VAE's
    attention, temporal attention, cross-attention unless `merge_crossattn` - goes straight to the
    inner processor.

    It is an `nn.Module` so that an inner processor with weights (IP-Adapter) moves with `.to()`;
    it has no parameters of its own.

    Args:
        inner: the processor to run on the merged tokens; default `AttnProcessor2_0()` (SDPA).
        config: a `ToMeConfig`; keyword options (`ratio=...`) override its fields.

    Example:
        >>> from tome_processors import ToMeProcessor
        >>> unet.set_attn_processor(ToMeProcessor(ratio=0.5))  # doctest: +SKIP

    Setting it with `set_attn_processor` attaches the block-level merge context (hooks) to the model
    at its first call, which already merges; `apply_tome(model)` does the same at once and keeps
    existing processors. Setting other processors again stands the context down at the next forward.
    """

    def __init__(self, inner: Any = None, config: ToMeConfig | None = None, **config_kwargs: Any) -> None:
        super().__init__()
        config = ToMeConfig.from_kwargs(config, **config_kwargs)
        if isinstance(inner, ToMeProcessor):  # never nest: wrap what it wraps
            inner = inner.inner
        if inner is None:
            inner = AttnProcessor2_0()
        if not callable(inner):
            raise TypeError(f"Expected inner to be a callable attention processor, but got {type(inner).__name__}.")
        self.config = config
        self.inner = inner
        # Instance attribute: found by `processor.__call__` lookups (diffusers' signature check)
        # while calls still go through nn.Module.__call__ -> forward.
        self.__dict__["__call__"] = _SignedCall(self, _inner_signature(inner))
        # Attention modules where this processor, set without `apply_tome`, found nothing to attach to.
        self._passed_through = PassedThrough()

    def extra_repr(self) -> str:
        return f"inner={type(self.inner).__name__}, config={self.config}"

    def __getattr__(self, name: str) -> Any:
        # diffusers' `set_attention_backend` and friends look for attributes of the processor.
        if name in _FORWARDED:
            return getattr(self._inner_processor(), name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        # ... and set them (`processor._attention_backend = backend`): that must reach the inner one.
        if name in _FORWARDED and hasattr(self._inner_processor(), name):
            setattr(self._inner_processor(), name, value)
            return
        super().__setattr__(name, value)

    def _inner_processor(self) -> Any:
        return self.__dict__.get("inner") or self._modules.get("inner")

    def forward(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        slot = getattr(attn, SLOT_ATTR, None)
        if slot is None:  # set with `set_attn_processor`: attach to the model being called (attach.py)
            slot = slot_for_call(attn, self.config, type(self), self._passed_through)
        if slot is None or hidden_states.ndim != 3:
            return self.inner(attn, hidden_states, *args, **kwargs)
        if slot.layout is Layout.ROTARY:  # video tokens with a rotary table row each (Wan)
            return run_with_rotary(self, slot, attn, hidden_states, args, kwargs)
        if slot.layout is not Layout.IMAGE:  # image tokens next to text tokens (SD3, Flux)
            return run_with_text(self, slot, attn, hidden_states, args, kwargs)
        if self.config.mode == "downsample_kv":
            keys_values = self._pooled_keys_values(slot, hidden_states, args, kwargs)
            if keys_values is not None:  # self-attention over pooled keys/values: K, V = f(pooled)
                if args:
                    args = (keys_values, *args[1:])
                else:
                    kwargs = {**kwargs, "encoder_hidden_states": keys_values}
            return self.inner(attn, hidden_states, *args, **kwargs)
        merge = self._merge_for(slot, hidden_states, args, kwargs)
        if merge is None:
            return self.inner(attn, hidden_states, *args, **kwargs)
        out = self.inner(attn, merge.merge(hidden_states), *args, **kwargs)
        return merge.unmerge(out)

    def _merge_for(
        self,
        slot: AttentionSlot,
        hidden_states: torch.Tensor,
        args: tuple,
        kwargs: dict,
        text: int = 0,
        text_rows: bool = False,
    ) -> TokenMerge | None:
        """The block's merge for `hidden_states` (see `BlockState.merge_for` for `text`), or None."""
        config = self.config
        if not (config.merge_crossattn if slot.is_cross else config.merge_attn):
            return None
        mask = argument(args, kwargs, 1, "attention_mask")
        if mask is not None and (not slot.is_cross or mask.shape[-2] != 1):
            return None  # a mask over the merged tokens would no longer line up
        block = slot.block
        merge = block.merge_for(config, text, text_rows) if text or text_rows else block.merge_for(config)
        if merge is None or (merge.batch, merge.num_tokens) != tuple(hidden_states.shape[:2]):
            return None
        return merge

    def _pooled_keys_values(
        self, slot: AttentionSlot, hidden_states: torch.Tensor, args: tuple, kwargs: dict
    ) -> torch.Tensor | None:
        config = self.config
        if slot.is_cross or not config.merge_attn:
            return None
        if argument(args, kwargs, 0, "encoder_hidden_states") is not None:
            return None
        if argument(args, kwargs, 1, "attention_mask") is not None:
            return None
        grid = slot.block.grid(hidden_states.shape[1])
        if grid is None or not slot.block.applies(config, grid):
            return None
        return pool_tokens(hidden_states, grid.h, grid.w, config.kv_factor, config.kv_pool)


#: Attributes that diffusers reads and sets on processors, kept on the inner processor.
_FORWARDED = frozenset({"_attention_backend", "_parallel_config"})
