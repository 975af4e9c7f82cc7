"""`ToMeProcessor`: merge the tokens, run the inner attention processor, unmerge its output."""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.attention_processor import (
    AttnProcessor2_0,
    FusedAttnProcessor2_0,
    JointAttnProcessor2_0,
    LuminaAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_ltx2 import LTX2PerturbedAttnProcessor
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from diffusers.models.transformers.transformer_sana_video import SanaLinearAttnProcessor3_0
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from ._similarity import is_compiling
from .arguments import argument
from .attach import PassedThrough, built_processor_for_call, slot_for_call, watch_compiles
from .built import missing_inner_error
from .config import ToMeConfig
from .context import SLOT_ATTR, AttentionSlot
from .families import Layout, class_default_processor, mask_where, set_processor
from .joint_attention import KEY_MASKS, run_with_text
from .merge import TokenMerge, pool_tokens
from .rotary_attention import run_with_rotary
from .skips import Skip


def _signed_class(base: type, signature: inspect.Signature) -> type:
    """`base`'s subclass for processors around an inner processor of `signature`: its `__call__` shows that
    signature, as diffusers inspects it.

    `Attention.forward` keeps only the keyword arguments named in `inspect.signature(processor.__call__)`,
    so a wrapper must show its inner processor's parameters or IP-Adapter masks and custom keyword
    arguments are silently dropped. The signature sits on the class's `__call__` (an instance attribute
    would be invisible to Python's call and to torch.compile, which inlines only a class's `__call__`);
    one class per signature, so that one compiled block serves every block (regional compilation,
    `compile_repeated_blocks`), as torch.compile guards on the processor's type.
    """
    key = (base, signature)
    try:
        signed = _SIGNED_CLASSES.get(key)
    except TypeError:  # a signature with unhashable defaults: a class of its own
        signed, key = None, None
    if signed is None:
        __call__ = _call_of(base)
        parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *signature.parameters.values()]
        __call__.__signature__ = _TraceableSignature(parameters, return_annotation=signature.return_annotation)  # type: ignore[attr-defined]
        namespace = {"__call__": __call__, "__module__": base.__module__, "__qualname__": base.__qualname__}
        signed = type(base.__name__, (base,), namespace)
        signed._signed_base = base
        if key is not None:
            _SIGNED_CLASSES[key] = signed
    return signed


def _call_of(base: type) -> Callable[..., Any]:
    """A `__call__` for `base`'s signed class: a copy of `base.forward` (no extra Python call per attention), or,
    where `forward` is no plain function, one that calls it. The copy is made once per class: a `forward` patched
    on the class or an instance later is not what a call runs."""
    forward = inspect.getattr_static(base, "forward")  # as the class holds it: a descriptor stays itself
    if isinstance(forward, types.FunctionType):
        call = types.FunctionType(
            forward.__code__, forward.__globals__, "__call__", forward.__defaults__, forward.__closure__
        )
        call.__kwdefaults__ = forward.__kwdefaults__
        call.__qualname__ = f"{base.__qualname__}.__call__"
        call.__doc__ = forward.__doc__
        return call

    def __call__(self: ToMeProcessor, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    return __call__


#: `_signed_class`'s class for each base and signature.
_SIGNED_CLASSES: dict[tuple[type, inspect.Signature], type] = {}


#: `_TraceableSignature.replace`'s default: keep what the signature has.
_KEEP = object()


class _TraceableSignature(inspect.Signature):
    """A signature whose `parameters` is a plain dict: torch.compile cannot read a `Signature`'s own
    mapping proxy once the traced code has mutated any dict (FLUX.1's forward pops from its
    `joint_attention_kwargs`), and would break the graph at diffusers' keyword filter."""

    __slots__ = ("_plain",)

    def __init__(
        self,
        parameters: Any = None,
        *,
        return_annotation: Any = inspect.Signature.empty,
        __validate_parameters__: bool = True,
    ) -> None:
        super().__init__(
            parameters, return_annotation=return_annotation, __validate_parameters__=__validate_parameters__
        )
        self._plain = dict(self._parameters)

    @property
    def parameters(self) -> dict[str, inspect.Parameter]:  # type: ignore[override]
        return dict(self._plain)  # a copy, as the mapping proxy could not be changed through

    def replace(self, *, parameters: Any = _KEEP, return_annotation: Any = _KEEP) -> _TraceableSignature:  # type: ignore[override]
        # What `inspect.signature` does to a bound method's signature (drops `self`) on every attention call
        # diffusers makes: the parameters were checked when this signature was made.
        return type(self)(
            list(self._plain.values()) if parameters is _KEEP else parameters,
            return_annotation=self.return_annotation if return_annotation is _KEEP else return_annotation,
            __validate_parameters__=False,
        )


def _processor_signature(inner: Any) -> inspect.Signature:
    """What a processor around `inner` shows: `inner`'s signature; without one, `_DEFAULT_SIGNATURE`."""
    return _inner_signature(inner) if inner is not None else _DEFAULT_SIGNATURE


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


class _BuiltProcessors:
    """The processors a `ToMeProcessor()` without an inner one runs on modules it merges nothing in (held weakly)."""

    def __init__(self) -> None:
        self._processors: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()

    def get(self, module: torch.nn.Module) -> Any:
        return self._processors.get(module)

    def set(self, module: torch.nn.Module, processor: Any) -> None:
        self._processors[module] = processor

    def values(self) -> list[Any]:
        return list(self._processors.values())

    def __reduce__(self) -> tuple:  # pickling or deep-copying a processor must not copy modules
        return (_BuiltProcessors, ())


#: `object`'s own `__class__` slot: what the `__class__` property's setter assigns through.
_OBJECT_CLASS = object.__dict__["__class__"]


def _new_processor(base: type, inner: Any) -> Any:
    """An empty processor of `base` around `inner`'s signature, filled by `__setstate__` (pickle, `copy.deepcopy`)."""
    return object.__new__(_signed_class(base, _processor_signature(inner)))


def _checked_inner(inner: Any) -> Any:
    """The processor a `ToMeProcessor` around `inner` runs: `inner`, or what it wraps where it is one (never nested).

    Raises:
        TypeError: where `inner` is neither None nor callable.
    """
    if isinstance(inner, ToMeProcessor):
        inner = inner.inner
    if inner is not None and not callable(inner):
        raise TypeError(f"Expected inner to be a callable attention processor, but got {type(inner).__name__}.")
    return inner


class ToMeProcessor:
    """An attention processor that runs its inner processor on merged tokens.

    It wraps ("chains") any diffusers attention processor (SDPA, xFormers, IP-Adapter, your own):
    on a self-attention module inside a spatial transformer block it merges the tokens (the merge
    computed once per block and forward from the raw block input, as in tomesd), calls the inner
    processor on them, and copies the output back to every token. Everything else - the VAE's
    attention, temporal attention, cross-attention unless `merge_crossattn` - goes straight to the
    inner processor.

    It stands in for its inner processor, as a proxy does: `p.__class__` is the inner processor's class,
    so `isinstance(p, IPAdapterAttnProcessor2_0)` holds where it wraps one (diffusers' checks pass), while
    `isinstance(p, ToMeProcessor)` holds too (`type(p)` is a subclass of `ToMeProcessor` per signature of the
    inner processor's `__call__`, which its own `__call__` shows); attributes it lacks are the
    inner processor's, read and written (`pipe.set_ip_adapter_scale` writes `processor.scale`, and the
    inner processor's scale changes; `del` too). Without an inner processor such a write stays on this
    one and goes on to every processor it builds. So an attention module holds it exactly as it would
    hold the inner processor: a plain
    attribute around a processor without weights (`attn.processor = ...` replaces it, as PAG pipelines do),
    a registered submodule around one with weights (IP-Adapter), whose weights keep their names in
    `state_dict()` and move with `.to()`. It has no weights of its own.

    Args:
        inner: the processor to run on the merged tokens. Without one, each attention module runs the
            processor its model builds it with (`AttnProcessor2_0` on UNets and PixArt,
            `JointAttnProcessor2_0` on SD3, `FluxAttnProcessor` on Flux): at its first call the module
            gets a `ToMeProcessor` around a new one, as `apply_tome` would have set. Where ToMe cannot tell
            which processor that is, the first call raises a `ValueError` that says what to pass.
        config: a `ToMeConfig`; keyword options (`ratio=...`) override its fields. Made with neither
            (`ToMeProcessor()`, as diffusers re-creates processors by class when it loads an IP-Adapter),
            it takes the configuration of the ToMe already on the model, else the defaults.

    Example:
        >>> from tome_processors import ToMeProcessor
        >>> unet.set_attn_processor(ToMeProcessor(ratio=0.5))  # doctest: +SKIP

    Setting it with `set_attn_processor` attaches the block-level merge context (hooks) to the model
    at its first call, which already merges; `apply_tome(model)` does the same at once and keeps
    existing processors. Setting other processors again stands the context down at the next forward.
    """

    #: On a `_signed_class` subclass, the class it was made from (None on that class itself).
    _signed_base: type | None = None

    def __new__(cls, inner: Any = None, config: ToMeConfig | None = None, **config_kwargs: Any) -> ToMeProcessor:
        return object.__new__(_signed_class(cls._signed_base or cls, _processor_signature(_checked_inner(inner))))

    def __init__(self, inner: Any = None, config: ToMeConfig | None = None, **config_kwargs: Any) -> None:
        #: Made without any configuration: a module with ToMe on it already runs under that ToMe's.
        self._takes_model_config = config is None and not config_kwargs
        config = ToMeConfig.from_kwargs(config, **config_kwargs)
        inner = _checked_inner(inner)
        self.config = config
        self.inner = inner  # None: the processor each module is built with (`built_inner`)
        # Attention modules where this processor, set without `apply_tome`, found nothing to attach to.
        self._passed_through = PassedThrough()
        self._built = _BuiltProcessors()  # without an inner processor: what runs on those modules
        # Under torch.compile on `Attention` without an inner processor, and pooled keys around a fused one.
        self._sdpa = AttnProcessor2_0() if inner is None or isinstance(inner, FusedAttnProcessor2_0) else None
        # A model compiled before any call attaches before its first trace (attach.py).
        watch_compiles(type(self)._signed_base)

    # Type transparency: code that checks a processor's type (diffusers' IP-Adapter checks,
    # `isinstance(p, FluxIPAdapterAttnProcessor)` over `model.attn_processors`, users' code) sees the
    # processor this one wraps, as `unittest.mock`'s `spec` and `wrapt.ObjectProxy` answer `__class__`.
    # `type(p)` stays a `ToMeProcessor`, and `isinstance` checks it first: `isinstance(p, ToMeProcessor)` holds.
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        if torch._guards.TracingContext.try_get() is not None:
            return type(self)  # while torch.compile traces, the true type: it resolves methods through `__class__`
        inner = self._inner_processor()
        return type(self)._signed_base if inner is None else inner.__class__

    @__class__.setter
    def __class__(self, value: type) -> None:
        _OBJECT_CLASS.__set__(self, value)

    def __reduce_ex__(self, protocol: int) -> tuple:
        # pickle refuses `object`'s reduction where `__class__` is not the type, and the type, made per signature,
        # is found by no name: rebuilt from the class it was made from, the inner processor and the state.
        return (_new_processor, (type(self)._signed_base or type(self), self.inner), self.__getstate__())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        watch_compiles(type(self)._signed_base)

    def extra_repr(self) -> str:
        """What `repr` shows inside the parentheses: the inner processor and the configuration."""
        inner = type(self.inner).__name__ if self.inner is not None else "each module's own"
        return f"inner={inner}, config={self.config}"

    def __getattr__(self, name: str) -> Any:
        # Only for names this processor lacks. diffusers' `set_attention_backend` and friends look for
        # attributes of the processor; without an inner processor yet, none is set (`built_inner` hands on
        # what is set meanwhile).
        inner = self._inner_processor()
        if name in _READ_AS_NONE:
            return getattr(inner, name) if inner is not None else None
        # Everything else is the inner processor's: its weights (`p.to_k_ip`) and, where it is an `nn.Module`
        # and so registered on the attention module, what torch calls on a submodule (`_apply` for `.to()`,
        # `state_dict`, `named_modules`, `train`). Special names stay this object's (copy and pickle ask).
        if inner is not None and not (name.startswith("__") and name.endswith("__")):
            return getattr(inner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # Writes go where reads come from, as with `wrapt.ObjectProxy`: this processor's own names here, every
        # other one to the inner processor (`set_ip_adapter_scale` writes `processor.scale`, diffusers'
        # `set_attention_backend` `processor._attention_backend`), which is what runs.
        if _is_own(type(self), name):
            object.__setattr__(self, name, value)
            return
        inner = self._inner_processor()
        if inner is not None:
            setattr(inner, name, value)
            return
        # Without an inner processor: kept here, and handed to every processor this one builds (`built_inner`).
        object.__setattr__(self, name, value)
        for built in self._built.values():
            setattr(built, name, value)

    def __delattr__(self, name: str) -> None:
        inner = self._inner_processor()
        if _is_own(type(self), name) or inner is None:
            object.__delattr__(self, name)
        else:
            delattr(inner, name)

    def _inner_processor(self) -> Any:
        return self.__dict__.get("inner")

    def built_inner(self, attn: torch.nn.Module, built_with: type | None = None) -> Any:
        """The processor this one runs on `attn`: `inner`, or without one a new processor of the class
        `attn` is built with (`built_with` where its model's family names one, else its class's default).

        Raises:
            ValueError: without an inner processor, where ToMe cannot tell which one `attn` is built with.

        Example:
            >>> from diffusers.models.attention_processor import Attention
            >>> type(ToMeProcessor().built_inner(Attention(query_dim=8))).__name__
            'AttnProcessor2_0'
        """
        inner = self._inner_processor()
        if inner is not None:
            return inner
        processor_class = built_with or class_default_processor(attn)
        if processor_class is None:
            raise missing_inner_error(attn)
        inner = processor_class()
        for name, value in self.__dict__.items():  # written before this module's first call (`__setattr__`)
            if not _is_own(type(self), name):
                setattr(inner, name, value)
        return inner

    def forward(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """Merge, run the inner processor, unmerge: what a call runs (the class's `__call__` is a copy of this method,
        made with the class, that shows the inner's signature)."""
        slot = getattr(attn, SLOT_ATTR, None)
        if slot is None:  # set with `set_attn_processor`: attach to the model being called (attach.py)
            slot = slot_for_call(attn, self.config, type(self)._signed_base, self._passed_through)
        inner = self._inner_processor()
        if inner is None:
            return self._run_built(slot, attn, hidden_states, args, kwargs)
        # Nothing merged here: no block state at all, or the pays rule turned this block's merging off.
        if slot is None or (slot.block.factor == 0 and self.config.pays_only) or hidden_states.ndim != 3:
            if slot is not None:
                slot.skip(Skip.NOT_TOKENS if hidden_states.ndim != 3 else Skip.PAYS, hidden_states)
            return inner(attn, hidden_states, *args, **kwargs)
        if slot.layout is Layout.ROTARY:  # video tokens with a rotary table row each (Wan)
            return run_with_rotary(self, slot, attn, hidden_states, args, kwargs)
        if slot.layout is not Layout.IMAGE:  # image tokens next to text tokens (SD3, Flux)
            return run_with_text(self, slot, attn, hidden_states, args, kwargs)
        if self.config.mode == "downsample_kv":
            keys_values = self._pooled_keys_values(slot, hidden_states, args, kwargs)
            if keys_values is None:
                return self.inner(attn, hidden_states, *args, **kwargs)
            # Self-attention over pooled keys/values: K, V = f(pooled).
            if args:
                args = (keys_values, *args[1:])
            else:
                kwargs = {**kwargs, "encoder_hidden_states": keys_values}
            inner = self.inner
            if self._sdpa is not None and getattr(attn, "to_kv", None) is None:
                # The fused processor projects other tokens with `to_kv`, which a fused self-attention lacks (it
                # has `to_qkv`): its queries come from the tokens and its keys from the pooled ones, so the fused
                # projection cannot serve; its `to_q`, `to_k`, `to_v` hold the same weights.
                inner = self._sdpa
            return inner(attn, hidden_states, *args, **kwargs)
        merge = self._merge_for(slot, hidden_states, args, kwargs)
        if merge is None:
            return self.inner(attn, hidden_states, *args, **kwargs)
        out = self.inner(attn, merge.merge(hidden_states), *args, **kwargs)
        return merge.unmerge(out)

    def _run_built(
        self, slot: AttentionSlot | None, attn: torch.nn.Module, hidden_states: torch.Tensor, args: tuple, kwargs: dict
    ) -> Any:
        """A call without an inner processor: run the one `attn` is built with (module doc of `built_inner`)."""
        if slot is None:  # nothing merged here (the VAE's attention, a module called on its own)
            if is_compiling():  # no weak mapping inside a traced graph: `Attention`'s default, made at construction
                inner = self._sdpa if class_default_processor(attn) is AttnProcessor2_0 else self.built_inner(attn)
                return inner(attn, hidden_states, *args, **_accepted(inner, kwargs))
            inner = self._built.get(attn)
            if inner is None:
                inner = self.built_inner(attn, built_processor_for_call(attn))
                self._built.set(attn, inner)
            # Only what that processor takes: this one's signature is the union of several (`_union_signature`).
            return inner(attn, hidden_states, *args, **_accepted(inner, kwargs))
        current = getattr(attn, "processor", None)
        if is_compiling() and isinstance(current, ToMeProcessor) and current._inner_processor() is not None:
            wrapper = current  # replaced when the context was attached outside the graph (attach.py)
        elif is_compiling():
            wrapper = self._built_wrapper(attn, slot)
        else:  # from now on this module holds what `apply_tome` would have set
            wrapper = self.replace_built(attn, slot)
        return wrapper(attn, hidden_states, *args, **_accepted(wrapper.inner, kwargs))

    def _built_wrapper(self, attn: torch.nn.Module, slot: AttentionSlot) -> ToMeProcessor:
        config = slot.block.model.config if self._takes_model_config else self.config
        inner = self.built_inner(attn, slot.built_with)
        parallel = slot.block.model.parallel_config
        if parallel is not None and getattr(inner, "_parallel_config", False) is None:
            # Set after `enable_parallelism`, which handed its config to the processors then in place: the one
            # built here attends over every rank's tokens as they do.
            inner._parallel_config = parallel
        return ToMeProcessor(inner, config)

    def replace_built(self, attn: torch.nn.Module, slot: AttentionSlot) -> ToMeProcessor:
        """Set on `attn` (merged, at `slot`) what this processor without an inner one runs there: a
        `ToMeProcessor` around the processor `attn` is built with, as `apply_tome` would have set. Returns it."""
        wrapper = self._built_wrapper(attn, slot)
        set_processor(attn, wrapper)
        return wrapper

    def _merge_for(
        self,
        slot: AttentionSlot,
        hidden_states: torch.Tensor,
        args: tuple,
        kwargs: dict,
        text: int = 0,
        text_rows: bool = False,
        tail: int = 0,
        mask_fits: bool = False,
    ) -> TokenMerge | None:
        """The block's merge for `hidden_states` (see `BlockState.merge_for` for `text`), or None (said through
        `AttentionSlot.skip`).

        `tail`: tokens after the grid's, each a row of its own (`TokenMerge.with_tail_rows`); `mask_fits`:
        the caller cuts an attention mask down to the merged tokens (joint_attention.py). Tokens that are the
        block's cut into windows along the batch (HiDiffusion) are merged inside each window
        (`BlockState.window_merge`).
        """
        config = self.config
        if not (config.merge_crossattn if slot.is_cross else config.merge_attn):
            slot.skip(Skip.FLAG_OFF)
            return None
        mask = argument(args, kwargs, *mask_where(slot.mask_at))
        if slot.is_cross and isinstance(mask, torch.Tensor) and (mask.ndim == 2 or mask.shape[-2] == 1):
            # A cross-attention's mask over its keys (the text), `(B, 1, L)` or `(B, L)` (Lumina-Next's): merged
            # queries leave it in line.
            mask = None
        masks = [m for m in (mask, *(kwargs.get(name) for name in KEY_MASKS)) if m is not None]
        # A mask over the merged tokens would no longer line up, unless the caller cuts it (tensors only: Qwen-Image
        # 2.1's flex `BlockMask` cannot be cut).
        if masks and not (mask_fits and all(isinstance(m, torch.Tensor) for m in masks)):
            slot.skip(Skip.MASK, hidden_states)
            return None
        block = slot.block
        if text or text_rows or tail:
            merge = block.merge_for(config, text, text_rows, tail)
        else:
            metric = block.metric
            if metric is not None and metric.shape[0] != hidden_states.shape[0]:  # before the block's merge is made
                return self._window_merge(slot, hidden_states)
            merge = block.merge_for(config)
        if merge is None:
            slot.skip(block.skipped or Skip.NO_BLOCK_INPUT, hidden_states)
            return None
        if (merge.batch, merge.num_tokens) != tuple(hidden_states.shape[:2]):
            slot.skip(Skip.SHAPE, hidden_states)
            return None
        return merge

    def _window_merge(self, slot: AttentionSlot, hidden_states: torch.Tensor) -> TokenMerge | None:
        """The merge inside each window of `hidden_states`, the block's tokens as windows stacked in the batch, or
        None (said)."""
        merge = slot.block.window_merge(self.config, hidden_states)
        if isinstance(merge, Skip):
            slot.skip(merge, hidden_states)
            return None
        return merge

    def _pooled_keys_values(
        self, slot: AttentionSlot, hidden_states: torch.Tensor, args: tuple, kwargs: dict
    ) -> torch.Tensor | None:
        """`hidden_states` pooled as the grid they form at their block's level, or None (said through
        `AttentionSlot.skip`). Tokens that are the block's cut into windows along the batch (HiDiffusion) are
        pooled inside each window, with the block's level's factor."""
        config = self.config
        if slot.is_cross or not config.merge_attn:
            slot.skip(Skip.KV_CROSS if slot.is_cross else Skip.FLAG_OFF)
            return None
        if argument(args, kwargs, 0, "encoder_hidden_states") is not None:
            slot.skip(Skip.TEXT_IN_SELF, hidden_states)
            return None
        if argument(args, kwargs, 1, "attention_mask") is not None:
            slot.skip(Skip.MASK, hidden_states)
            return None
        block = slot.block
        metric = block.metric
        # Another batch than the block's: windows (whose token count alone would pass for another level's grid).
        if metric is not None and metric.shape[0] != hidden_states.shape[0]:
            grid = block.window_grid(hidden_states.shape[0], hidden_states.shape[1])
        else:
            grid = block.grid(hidden_states.shape[1])
        if grid is None or isinstance(grid, Skip):
            slot.skip(grid or Skip.NO_GRID, hidden_states)
            return None
        if not block.applies(config, grid):
            off = config.level_ratio(grid.downsample, block.model.max_downsample(config)) <= 0
            slot.skip(Skip.LEVEL_OFF if off else Skip.PAYS)
            return None
        return pool_tokens(hidden_states, grid.h, grid.w, block.pays(config, grid.downsample), config.kv_pool)


#: Attributes diffusers reads from processors that read as None on a `ToMeProcessor()` without an inner one.
_READ_AS_NONE = frozenset({"_attention_backend", "_parallel_config"})
#: A `ToMeProcessor`'s own attributes: writes of any other name reach the inner processor (`__setattr__`).
#: An attribute added to the class must be listed here or start with `_tome_`.
_OWN = frozenset({"config", "inner", "_takes_model_config", "_passed_through", "_built", "_sdpa"})


def _is_own(cls: type, name: str) -> bool:
    """Whether `name` is a `ToMeProcessor`'s own attribute, written on it rather than on its inner processor:
    the listed names, any `_tome_` name, and the names its class defines (`__class__`, methods)."""
    return name in _OWN or name.startswith("_tome_") or hasattr(cls, name)


def _union_signature(processors: list[type]) -> inspect.Signature:
    """`(attn, hidden_states, *, every other parameter of any of processors=None)`: what a `ToMeProcessor`
    without an inner processor shows diffusers' keyword filter, so that no keyword its module's built-with
    processor takes is dropped before that processor is known (Qwen-Image's `encoder_hidden_states_mask`)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    leading = [inspect.Parameter("attn", kind), inspect.Parameter("hidden_states", kind)]
    names: dict[str, inspect.Parameter] = {}
    for processor in processors:
        for name, parameter in list(inspect.signature(processor.__call__).parameters.items())[3:]:
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                names.setdefault(name, inspect.Parameter(name, parameter.KEYWORD_ONLY, default=None))
    return inspect.Signature([*leading, *names.values()])


def _accepted(inner: Any, kwargs: dict) -> dict:
    """`kwargs` less the names `inner.__call__` takes no parameter for (as diffusers' own keyword filter)."""
    if not kwargs:
        return kwargs
    names = _accepted_names(type(inner))
    return kwargs if names is None else {name: value for name, value in kwargs.items() if name in names}


@functools.cache
def _accepted_names(processor_type: type) -> frozenset[str] | None:
    # Per processor class, once: modules ToMe merges nothing in come through `_accepted` every forward.
    try:
        parameters = inspect.signature(processor_type.__call__).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return None
    return frozenset(parameters)


#: What a `ToMeProcessor` without an inner processor shows diffusers' keyword filter (`_union_signature`).
_DEFAULT_SIGNATURE = _union_signature(
    [
        AttnProcessor2_0,
        JointAttnProcessor2_0,
        FluxAttnProcessor,
        LTX2PerturbedAttnProcessor,  # LTX-2.3's STG: `perturbation_mask`, `all_perturbed`
        LuminaAttnProcessor2_0,  # Lumina-Next's proportional attention: `base_sequence_length`
        QwenDoubleStreamAttnProcessor2_0,
        SanaLinearAttnProcessor3_0,  # Sana-Video's linear self-attention (an `Attention`, which filters): `rotary_emb`
        ZSingleStreamAttnProcessor,
    ]
)
