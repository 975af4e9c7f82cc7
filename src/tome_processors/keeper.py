"""Keep ToMe's processors in place while diffusers replaces attention processors for its own ends.

diffusers' model methods that fuse projections, switch kernels, load IP-Adapters or set the default
processor replace every attention processor, or read the current ones by class before doing so. A
wrapper processor would be dropped by the first kind (ToMe silently off) and would mislead the second.
So while ToMe is on a model, a `ProcessorKeeper` wraps those methods on the instance, as accelerate
wraps `forward`: during the call the model holds its plain inner processors, so diffusers sees and
keeps exactly what it would see without ToMe; afterwards every processor is wrapped again.

`set_attn_processor` is the user's own switch. Under `apply_tome` setting other processors with it turns
ToMe off (the context stands down at the next forward, and says so once), except where a pipeline sets processors
of its own (called from a pipeline's method: Attend-and-Excite's attention store; the fused projections'
processor on a model whose projections are fused, which a pipeline's `fuse_qkv_projections()` sets after the
model's own): those are wrapped, and ToMe stays on. Under
`pipe.enable_tome()` (`keep_all`), it is wrapped too, and a forward pre-hook wraps again whatever was
replaced some other way (`attn.processor = ...`, as PAG pipelines assign theirs): ToMe stays on until
`disable_tome()`. Without `keep_all`, a processor assigned that way runs as assigned on its module.

The wrapped methods and the pre-hook are objects (not closures) that hold the keeper and the method
they wrap, bound to the model: `copy.deepcopy` and `pickle` carry them over to the copy's own modules.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.models.attention_processor import FusedAttnProcessor2_0

from .families.base import set_processor

#: Model methods diffusers uses to replace processors for its own ends, or that read them by class first.
OWN_ENDS_METHODS = (
    "set_default_attn_processor",
    "fuse_qkv_projections",
    "unfuse_qkv_projections",
    "set_attention_slice",
    "set_use_memory_efficient_attention_xformers",
    "_load_ip_adapter_weights",
)
#: The user's own switch, kept only under `enable_tome` (`keep_all`).
USER_METHOD = "set_attn_processor"
#: Methods of each attention module that replace its processor: a pipeline's xFormers switch calls them on
#: every submodule itself, after the model's own method has returned.
ATTENTION_METHODS = ("set_use_memory_efficient_attention_xformers",)


class ProcessorKeeper:
    """Keeps every attention processor of one model wrapped in `processor_type(inner, config)`.

    Args:
        model: the merged model.
        attentions: its attention modules (what the keeper wraps and unwraps).
        processor_type: the wrapper class (`ToMeProcessor`).
        config: the wrappers' configuration.
        inner_of: `inner_of(attn, processor)`: the processor a wrapper runs on `attn`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attentions: list[torch.nn.Module],
        processor_type: type,
        config: Any,
        inner_of: Any,
    ) -> None:
        self.model = model
        self.attentions = attentions
        self.processor_type = processor_type
        self.config = config
        self.inner_of = inner_of
        self.wrappers: list[Any] = [None] * len(attentions)
        self.depth = 0
        self.keep_all = False
        self.methods: list[str] = []
        self.handle: torch.utils.hooks.RemovableHandle | None = None
        self.installed = False
        #: Per module, whether it held a ToMe processor when the outermost kept call unwrapped it: without
        #: `keep_all`, only those are wrapped again (a module the user set a plain processor on stays plain).
        self.held: list[bool] = [True] * len(attentions)

    def install(self, keep_all: bool = False) -> None:
        """Wrap the model's processor-setting methods (with `keep_all`, `set_attn_processor` too and a pre-hook)."""
        self.uninstall()
        self.keep_all = keep_all
        for index, attn in enumerate(self.attentions):
            if isinstance(attn.processor, self.processor_type):
                self.wrappers[index] = attn.processor
        for name in (*OWN_ENDS_METHODS, USER_METHOD):
            original = getattr(self.model, name, None)
            if callable(original) and name not in self.model.__dict__:
                kept = KeptMethod(self, original) if keep_all or name != USER_METHOD else FusingSwitch(self, original)
                self.model.__dict__[name] = kept
                self.methods.append(name)
        for index, attn in enumerate(self.attentions):
            for name in ATTENTION_METHODS:
                original = getattr(attn, name, None)
                if callable(original) and name not in attn.__dict__:
                    attn.__dict__[name] = KeptModuleMethod(self, index, original)
        if keep_all:
            # First among the model's pre-hooks: re-wrap before ToMe's own hook checks for ToMe processors.
            self.handle = self.model.register_forward_pre_hook(RewrapHook(self), prepend=True)
        self.installed = True

    def uninstall(self) -> None:
        """Take the wrapped methods and the pre-hook away (nothing when not installed)."""
        for name in self.methods:
            if isinstance(self.model.__dict__.get(name), (KeptMethod, FusingSwitch)):
                del self.model.__dict__[name]
        self.methods.clear()
        for attn in self.attentions:
            for name in ATTENTION_METHODS:
                if isinstance(attn.__dict__.get(name), (KeptModuleMethod, _OwnMethod)):
                    del attn.__dict__[name]
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.installed = False

    def is_wrapped(self) -> bool:
        """Whether every attention module still holds the wrapper this keeper gave it (identity checks only)."""
        return all(attn.processor is wrapper for attn, wrapper in zip(self.attentions, self.wrappers, strict=True))

    def unwrap(self) -> None:
        """Every module's inner processor in place (all found before any is set)."""
        self.held = [self.keep_all or isinstance(attn.processor, self.processor_type) for attn in self.attentions]
        inners = [(attn, self._inner(attn)) for attn in self.attentions]
        for attn, inner in inners:
            if attn.processor is not inner:
                set_processor(attn, inner)

    def rewrap(self, only: int | None = None) -> None:
        """Wrap whatever each module (or module `only`) holds now (the same wrapper where its inner one is the same)."""
        if not self.installed:  # ToMe was removed meanwhile: nothing to keep
            return
        for index, attn in enumerate(self.attentions):
            if (only is not None and index != only) or not self.held[index]:
                continue
            processor = attn.processor
            if processor is self.wrappers[index]:
                continue
            processor = self._inner(attn)
            previous = self.wrappers[index]
            if previous is not None and previous.inner is processor:
                wrapper = previous
            else:
                wrapper = self.processor_type(processor, self.config)
            self.wrappers[index] = wrapper
            set_processor(attn, wrapper)

    def _inner(self, attn: torch.nn.Module) -> Any:
        processor = attn.processor
        return self.inner_of(attn, processor) if isinstance(processor, self.processor_type) else processor

    @contextmanager
    def unwrapped(self) -> Iterator[None]:
        """Plain inner processors inside the block, wrappers again after it (even on error)."""
        self.depth += 1
        try:
            if self.depth == 1:
                self.unwrap()
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.rewrap()


@contextmanager
def all_unwrapped(keepers: list[ProcessorKeeper]) -> Iterator[None]:
    """Every keeper's model with its plain inner processors inside the block (a pipeline's own methods)."""
    if not keepers:
        yield
        return
    with keepers[0].unwrapped(), all_unwrapped(keepers[1:]):
        yield


class KeptMethod:
    """A model method called with the plain inner processors in place (`ProcessorKeeper.unwrapped`)."""

    def __init__(self, keeper: ProcessorKeeper, method: Any) -> None:
        self.keeper = keeper
        self.method = method  # bound to the model: a deep copy binds it to the copy
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.keeper.unwrapped():
            return self.method(*args, **kwargs)


class FusingSwitch:
    """`set_attn_processor` under `apply_tome`: the user's own switch (ToMe off), except where a pipeline sets
    processors of its own, which ToMe wraps: a pipeline method calling it (Attend-and-Excite sets its attention
    store's processors at every call and puts the earlier ones back at the end), or the fused projections'
    processor on a model whose projections are fused (a pipeline's `fuse_qkv_projections()` sets it after the
    model's own `fuse_qkv_projections()`, kept already). ToMe stays on through both."""

    def __init__(self, keeper: ProcessorKeeper, method: Any) -> None:
        self.keeper = keeper
        self.method = method
        functools.update_wrapper(self, method)

    def __call__(self, processor: Any, *args: Any, **kwargs: Any) -> Any:
        fusing = isinstance(processor, FusedAttnProcessor2_0) and any(
            getattr(attn, "fused_projections", False) for attn in self.keeper.attentions
        )
        if fusing or _called_by_a_pipeline(sys._getframe(1)):
            with self.keeper.unwrapped():
                return self.method(processor, *args, **kwargs)
        return self.method(processor, *args, **kwargs)


def _called_by_a_pipeline(frame: FrameType | None) -> bool:
    """Whether `frame` runs a method of a diffusers pipeline (its `self` is a `DiffusionPipeline`)."""
    return frame is not None and isinstance(frame.f_locals.get("self"), DiffusionPipeline)


class KeptModuleMethod:
    """An attention module's own processor switch, called with that module's plain inner processor in place."""

    def __init__(self, keeper: ProcessorKeeper, index: int, method: Any) -> None:
        self.keeper = keeper
        self.index = index
        self.method = method
        functools.update_wrapper(self, method)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        keeper = self.keeper
        if keeper.depth > 0:  # inside a model method that unwrapped every module already
            return self.method(*args, **kwargs)
        attn = keeper.attentions[self.index]
        keeper.held[self.index] = keeper.keep_all or isinstance(attn.processor, keeper.processor_type)
        inner = keeper._inner(attn)
        if attn.processor is not inner:
            set_processor(attn, inner)
        try:
            return self.method(*args, **kwargs)
        finally:
            keeper.rewrap(only=self.index)

    def __deepcopy__(self, memo: dict) -> Any:
        # Copied with its model: the copy's keeper. Copied with the attention module alone (a block): that
        # module's own method, so that the copy does not drag the whole model along.
        name = self.method.__name__
        attn = memo.get(id(self.keeper.attentions[self.index]))  # the module being copied (in memo by now)
        if attn is None:
            return self.method
        if id(self.keeper.model) not in memo:
            return _OwnMethod(attn, name)
        keeper = copy.deepcopy(self.keeper, memo)
        return KeptModuleMethod(keeper, self.index, getattr(type(attn), name).__get__(attn))

    def __reduce__(self) -> tuple:  # pickled alone (a block saved on its own): the module's own method
        return (_OwnMethod, (self.keeper.attentions[self.index], self.method.__name__))


class _OwnMethod:
    """An attention module's class method, bound to it: what a `KeptModuleMethod` becomes in a copy of the module
    made without its model (pickling or copying a block on its own)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(type(self.module), self.name)(self.module, *args, **kwargs)


class RewrapHook:
    """`keep_all`'s forward pre-hook: wraps again what was replaced behind the wrapped methods' back."""

    def __init__(self, keeper: ProcessorKeeper) -> None:
        self.keeper = keeper

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        # Identity checks that torch.compile turns into guards it already has.
        keeper = self.keeper
        if keeper.depth == 0 and not keeper.is_wrapped():
            keeper.rewrap()
