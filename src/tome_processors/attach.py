"""Attach the merge context for processors set with `model.set_attn_processor(ToMeProcessor())`.

A processor cannot see the model it is set on, and the merge needs model-level facts (the token
grid, the timestep, the raw block input). So a `ToMeProcessor` called on an attention module that
has no `AttentionSlot` looks, at that call, for the model being called: the `nn.Module` calls that
are running, on the Python call stack. The outermost diffusers model of a supported family whose
blocks hold this attention module gets the merge context (as `apply_tome` would install it), and
this forward's context is started from the arguments that model and the block were called with,
so the first forward merges exactly as `apply_tome` would have (positional or keyword calls alike).

Nothing runs before a processor's first call. Options that `apply_tome` refuses on the model
(`Family.check_config`: `st=2` on an image model, K/V pooling on joint attention) raise the same `ValueError`
at that first call, before anything is attached. Where no such model is found inside a diffusers model's
forward (the VAE's attention), the attention module is remembered and passed straight through from then on. A
compiled model's first call is traced, not run, and hooks cannot be added inside a traced graph: so the first
`ToMeProcessor` made registers one function with dynamo's compile-start callbacks, the only thing ToMe
installs process-wide. When dynamo starts compiling a frame inside such a model (the whole model, or one of
its blocks), it attaches the context from the real frames of the calls that led there, before anything is
traced: the first compiled call merges as an eager one, in one graph. Where dynamo forgot that function
(`torch._dynamo.reset()` after the processor was made), the processor's
first compiled call attaches outside the graph (one graph break, at that call).

The block being called while the context is attached had no pre-hook this forward (its metric is
set here) and gets no post-hook either: its tensors are held until its next forward, a reset
(end of a pipeline call) or removal.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
import weakref
from typing import Any

import torch
from diffusers import ModelMixin

from ._similarity import is_compiling
from .built import missing_inner_error, rebuilt_processor
from .calls import module_calls
from .config import ToMeConfig
from .context import SLOT_ATTR, AttentionSlot
from .families import find_family, why_no_family
from .hooks import attention_modules, context_of, enter_block, install, warn_if_merges_nothing
from .plan import plan_tome
from .replaced import warn_replaced_forwards

logger = logging.getLogger(__name__)

_lock = threading.Lock()


class PassedThrough:
    """Attention modules a processor found no block to merge in, held weakly; copies start empty."""

    def __init__(self) -> None:
        self._modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def __contains__(self, module: object) -> bool:
        return module in self._modules

    def add(self, module: torch.nn.Module) -> None:
        self._modules.add(module)

    def __reduce__(self) -> tuple:  # pickling or deep-copying a processor must not copy modules
        return (PassedThrough, ())


def slot_for_call(
    attn: torch.nn.Module, config: ToMeConfig, processor_type: type, passed_through: PassedThrough
) -> AttentionSlot | None:
    """The slot of `attn` once the merge context is attached to the model being called, or None.

    Called by a processor of `processor_type` with `config`, set on `attn`, which has no slot.
    Returns None (pass straight through) outside a model's forward, and where the model does not merge
    `attn`; in the last case `attn` is added to `passed_through`.
    """
    if attn in passed_through:
        return None
    if is_compiling():
        return _attach_outside_graph(attn, config, processor_type, passed_through)
    return _attach_from_stack(attn, config, processor_type, passed_through)


def _attach_from_stack(
    attn: torch.nn.Module,
    config: ToMeConfig,
    processor_type: type,
    passed_through: PassedThrough,
    replace_built: bool = False,
) -> AttentionSlot | None:
    calls = module_calls(sys._getframe(1))
    with _lock:
        slot = getattr(attn, SLOT_ATTR, None)  # another thread may have attached meanwhile
        if slot is None:
            slot = _attach(attn, config, processor_type, calls, replace_built)
    if slot is None and any(isinstance(module, ModelMixin) for module, _, _ in calls):
        _tell_unsupported(attn, calls, processor_type)  # raises before any of that model's attention runs
        passed_through.add(attn)  # the VAE's attention, temporal attention, ...: never merged here
    return slot


#: Models of no supported family a ToMe processor has run in and said so (once per model).
_TOLD: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _owner(attn: torch.nn.Module, calls: list) -> torch.nn.Module | None:
    """The outermost diffusers model being called that holds `attn`, or None."""
    for model, _, _ in calls:
        if isinstance(model, ModelMixin) and any(module is attn for module in model.modules()):
            return model
    return None


def _tell_unsupported(attn: torch.nn.Module, calls: list, processor_type: type) -> None:
    """Where the model being called that holds `attn` is of no supported family: say once that ToMe merges nothing
    in it, and where a ToMe processor there has no inner processor and ToMe cannot tell the one its module is built
    with, raise, before any of the model's attention runs."""
    model = _owner(attn, calls)
    if model is None or model in _TOLD or find_family(model) is not None:
        return

    for module in attention_modules(model):
        processor = getattr(module, "processor", None)
        if isinstance(processor, processor_type) and processor.inner is None:
            if rebuilt_processor(model, module) is None:
                raise missing_inner_error(module)
    _TOLD.add(model)
    name = type(model).__name__
    warnings.warn(
        f"ToMe merges nothing in {name}: {why_no_family(model)} Its attention modules run the processor each "
        "ToMeProcessor wraps (without one, the processor the model builds them with), unchanged: the output is the "
        "model's own. (Said once per model.)",
        UserWarning,
        stacklevel=5,
    )


@torch.compiler.disable(
    reason="ToMe attaches its merge context here, at the first compiled call of a ToMeProcessor set with "
    "set_attn_processor, outside the graph: it could not before tracing, as torch._dynamo.reset() ran after the "
    "processor was made. With fullgraph=True, make the processor after the reset, call apply_tome(model) "
    "before torch.compile, or run one forward eagerly first."
)
def _attach_outside_graph(
    attn: torch.nn.Module, config: ToMeConfig, processor_type: type, passed_through: PassedThrough
) -> AttentionSlot | None:
    """`_attach_from_stack` for a compiled call that `_attach_before_tracing` did not see coming (dynamo forgot
    it): dynamo breaks the graph here and runs this eagerly, on the real frames of the module calls (the
    model's and its blocks' `_call_impl`), so this call merges too. The processors without an inner one are
    then replaced at once (eager calls do it module by module): later graphs hold no processor made in them."""
    watch_compiles(processor_type)
    return _attach_from_stack(attn, config, processor_type, passed_through, replace_built=True)


#: The processor classes whose instances `_attach_before_tracing` looks for (`watch_compiles`).
_WATCHED: set[type] = set()


def watch_compiles(processor_type: type) -> None:
    """Have dynamo call `_attach_before_tracing` whenever it starts compiling a frame (once per process, and
    again after `torch._dynamo.reset()`, which forgets it), for models holding processors of `processor_type`:
    called by every `ToMeProcessor` made."""
    _WATCHED.add(processor_type)
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is not None and _attach_before_tracing not in handler.start_callbacks:
        handler.register_start_callback(_attach_before_tracing)


def _attach_before_tracing(*_: object) -> None:
    """Attach the merge context, before dynamo traces anything, to the model being called whose attention
    modules hold ToMe processors set with `set_attn_processor` and no context yet.

    A compiled model's first call is traced, not run, so its processors cannot attach while it runs. Dynamo
    compiles a frame only when it has none that fits, before tracing it, from the real frames of the calls
    that led to it (the model's `_call_impl`): the frames it is about to trace find the context in place, and
    the first compiled call merges as an eager one, in one graph. It costs a walk of the stack per frame
    compiled, and one of the model's modules while it has ToMe processors and no context.
    """
    calls = module_calls(sys._getframe(1))
    for model, _, _ in calls:
        if not isinstance(model, ModelMixin) or context_of(model) is not None:
            continue
        family = find_family(model)
        if family is None:
            continue
        pending = _pending_processor(model, family)
        if pending is not None:
            attn, processor = pending
            with _lock:
                if getattr(attn, SLOT_ATTR, None) is None:
                    # The class it was made as: its type is that class's subclass for its inner's signature.
                    made_as = type(processor)._signed_base or type(processor)
                    _attach(attn, processor.config, made_as, calls, replace_built=True)
            return


def _pending_processor(model: torch.nn.Module, family: Any) -> tuple[torch.nn.Module, Any] | None:
    """The first attention module of `model`'s blocks that holds a ToMe processor, and that processor, or None."""
    kinds = tuple(_WATCHED)
    for site in family.blocks(model):
        for attention in site.attentions:
            processor = getattr(attention.module, "processor", None)
            if isinstance(processor, kinds):
                return attention.module, processor
    return None


def built_processor_for_call(attn: torch.nn.Module) -> type | None:
    """The processor class that the diffusers model being called, of a supported family, builds `attn` with, as
    its family tells (`Family.built_processor`), or None (no such model holds `attn`: its class's default runs).

    For the attention modules a `ToMeProcessor()` merges nothing in: LTX-2.3 builds its audio stream's with a
    processor other than its class's default.
    """
    for model, _, _ in module_calls(sys._getframe(1)):
        if not isinstance(model, ModelMixin) or not any(module is attn for module in attention_modules(model)):
            continue
        family = find_family(model)
        if family is not None:
            return family.built_processor(model, attn)
        # A model of no supported family: what its class builds (built.py), never a guess.
        built = rebuilt_processor(model, attn)
        if built is None:
            raise missing_inner_error(attn)
        return built
    return None


def _attach(
    attn: torch.nn.Module, config: ToMeConfig, processor_type: type, calls: list, replace_built: bool = False
) -> AttentionSlot | None:
    for model, args, kwargs in calls:
        if not isinstance(model, ModelMixin):
            continue
        if context_of(model) is not None:
            break  # merged already, and `attn` has no slot there: not one of its blocks' attention
        family = find_family(model)
        if family is None:
            continue
        sites = family.blocks(model)
        site = next((s for s in sites if any(a.module is attn for a in s.attentions)), None)
        if site is None:
            continue
        # The options `apply_tome` refuses on this model (`st=2` on an image model, K/V pooling on joint attention)
        # are refused here too, by the plan, before anything is installed: this forward raises, and so would the next.
        plan = plan_tome(model, config, family=family)
        warn_if_merges_nothing(model, config, stacklevel=5, family=family, sites=plan.sites)
        context = install(plan, processor_type)
        warn_replaced_forwards(model, context.slotted, stacklevel=5)
        # This forward's pre-hooks ran before the hooks existed: start its context from the calls themselves.
        context.begin(model, args, kwargs)
        block_state = context.block_of(site.module)
        for module, block_args, block_kwargs in calls:
            if module is site.module and block_state is not None:
                enter_block(block_state, block_args, block_kwargs, site)
        if replace_built:
            for module in context.slotted:
                processor = getattr(module, "processor", None)
                if isinstance(processor, processor_type) and processor.inner is None:
                    processor.replace_built(module, getattr(module, SLOT_ATTR))
        logger.debug("ToMe attached to %s at its first forward", type(model).__name__)
        return getattr(attn, SLOT_ATTR, None)
    return None
