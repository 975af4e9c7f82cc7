"""The processor each attention module of a model of no supported family is built with.

A `ToMeProcessor()` made without an inner processor runs, on a module it merges nothing in, the processor the
module's model builds it with. A supported family declares that (`Family.built_processor`); for any other model
the class's default is no answer (Sana's ControlNet builds its `Attention` modules with linear attention, CogVideoX
with a joint processor of its own). The model's class does know: building it again from its config, on the meta device
(no memory, no weights, no random numbers drawn), gives every module the processor it is built with. Done once per
model and kept beside it (weakly).
"""

from __future__ import annotations

import logging
import warnings
import weakref

import torch
from diffusers.configuration_utils import ConfigMixin
from diffusers.utils.torch_utils import unwrap_module

logger = logging.getLogger(__name__)

#: Per model: each attention module (held weakly) and the processor class its model builds it with, or None
#: where the model could not be built again.
_REBUILT: weakref.WeakKeyDictionary[torch.nn.Module, weakref.WeakKeyDictionary | None] = weakref.WeakKeyDictionary()


def rebuilt_processor(model: torch.nn.Module, attn: torch.nn.Module) -> type | None:
    """The processor class `model` builds its attention module `attn` with, read from `model`'s class built again
    from its config on the meta device; None where that cannot be told (no config, a build that fails there, a
    module the fresh model lacks).

    Example:
        >>> from diffusers import SanaTransformer2DModel
        >>> sana = SanaTransformer2DModel(
        ...     in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=4, num_layers=1,
        ...     num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
        ...     sample_size=8,
        ... )
        >>> rebuilt_processor(sana, sana.transformer_blocks[0].attn1).__name__
        'SanaLinearAttnProcessor2_0'
    """
    model = unwrap_module(model)
    if model not in _REBUILT:
        _REBUILT[model] = _rebuild(model)
    built = _REBUILT[model]
    return None if built is None else built.get(attn)


def _rebuild(model: torch.nn.Module) -> weakref.WeakKeyDictionary | None:
    if not isinstance(model, ConfigMixin) or not hasattr(type(model), "from_config"):
        return None
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # a config's unused keys, deprecations: the user saw them at load time
            fresh = type(model).from_config(model.config)
    except Exception as error:  # noqa: BLE001 - any failure means only that the answer is unknown
        logger.debug("ToMe could not build %s again on the meta device: %s", type(model).__name__, error)
        return None
    classes = {name: type(module.processor) for name, module in fresh.named_modules() if hasattr(module, "processor")}
    built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    for name, module in model.named_modules():
        if name in classes and hasattr(module, "processor"):
            built[module] = classes[name]
    return built


def missing_inner_error(attn: torch.nn.Module) -> ValueError:
    """The error for a `ToMeProcessor()` without an inner processor on a module whose processor ToMe cannot tell."""
    return ValueError(
        f"Expected ToMeProcessor to know the processor to run on {type(attn).__name__}, but got ToMeProcessor() "
        "without an inner processor, and ToMe cannot tell which processor this module is built with (its model "
        "is of no family ToMe supports and cannot be built again from its config to ask, or the module is called "
        "outside its model's forward). Pass it: "
        "ToMeProcessor(<the module's processor>, ratio=...), or use apply_tome(model), which wraps the "
        "processors already set."
    )
