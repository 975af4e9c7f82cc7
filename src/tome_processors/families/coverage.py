"""Every image and video transformer diffusers ships, and where ToMe stands on each: the family that merges in it,
or the reason ToMe refuses it.

`coverage()` reads the classes `diffusers.models.transformers` exports, so a diffusers release that adds a model
shows it here as neither merged nor refused (`Coverage.undecided`) until a family or a reason is declared for it.
docs/families.md carries `coverage_table()`.

Example:
    >>> from diffusers import FluxTransformer2DModel
    >>> family_for_class(FluxTransformer2DModel).name
    'flux'
"""

from __future__ import annotations

from dataclasses import dataclass

import diffusers.models.transformers as transformers
from diffusers import ModelMixin

from . import FAMILIES, REFUSED, Family

__all__ = [
    "MEASURED_PRESETS",
    "NOT_IMAGE_OR_VIDEO",
    "PIPELINES",
    "Coverage",
    "coverage",
    "coverage_table",
    "family_for_class",
    "presets_source",
]

#: The families whose presets were chosen from measured speed and the output change on a trained model of their
#: own shape (docs/options.md): the UNets, the PixArt-shaped DiT (PixArt, SD3), FLUX.1 and Wan. The others borrow
#: the presets of the nearest of these.
MEASURED_PRESETS = ("unet", "pixart", "sd3", "flux", "wan")

#: diffusers' transformer classes that make no image or video (audio, music, proteins, an image-embedding prior),
#: and the building blocks of the UNets (merged as the UNet family's blocks): not counted.
NOT_IMAGE_OR_VIDEO: dict[str, str] = {
    "AceStepTransformer1DModel": "audio",
    "LongCatAudioDiTTransformer": "audio",
    "MiniMaxMusic3RVQDepthDecoder": "music",
    "MiniMaxMusic3Transformer1DModel": "music",
    "StableAudio3DiTModel": "audio",
    "StableAudioDiTModel": "audio",
    "T5FilmDecoder": "music (spectrograms)",
    "RFD4ProteinaTransformer": "proteins",
    "PriorTransformer": "an image-embedding prior (Kandinsky 2, unCLIP): no image tokens",
    "Transformer2DModel": "a UNet's building block (the UNet family merges its blocks)",
    "TransformerTemporalModel": "a UNet's building block (temporal attention, never merged)",
}

#: The pipeline folders (`diffusers/pipelines/<folder>`) that build each class.
PIPELINES: dict[str, tuple[str, ...]] = {
    "AllegroTransformer3DModel": ("allegro",),
    "AnyFlowFARTransformer3DModel": ("anyflow",),
    "AnyFlowTransformer3DModel": ("anyflow",),
    "AuraFlowTransformer2DModel": ("aura_flow",),
    "BriaFibo2Transformer2DModel": ("bria_fibo2",),
    "BriaFiboTransformer2DModel": ("bria_fibo",),
    "BriaTransformer2DModel": ("bria",),
    "ChromaTransformer2DModel": ("chroma",),
    "ChronoEditTransformer3DModel": ("chronoedit",),
    "CogVideoXTransformer3DModel": ("cogvideo",),
    "CogView3PlusTransformer2DModel": ("cogview3",),
    "CogView4Transformer2DModel": ("cogview4",),
    "ConsisIDTransformer3DModel": ("consisid",),
    "Cosmos3OmniTransformer": (),
    "CosmosTransformer3DModel": ("cosmos",),
    "DiTTransformer2DModel": ("dit",),
    "DreamLiteTransformer2DModel": (),
    "EasyAnimateTransformer3DModel": ("easyanimate",),
    "ErnieImageTransformer2DModel": ("ernie_image",),
    "Flux2Transformer2DModel": ("flux2",),
    "Flux3Transformer2DModel": (),
    "FluxTransformer2DModel": ("flux",),
    "GlmImageTransformer2DModel": ("glm_image",),
    "HeliosTransformer3DModel": ("helios",),
    "HiDreamImageTransformer2DModel": ("hidream_image",),
    "HunyuanDiT2DModel": ("hunyuandit",),
    "HunyuanImageTransformer2DModel": ("hunyuan_image",),
    "HunyuanVideo15Transformer3DModel": ("hunyuan_video1_5",),
    "HunyuanVideoFramepackTransformer3DModel": ("hunyuan_video",),
    "HunyuanVideoTransformer3DModel": ("hunyuan_video",),
    "Ideogram4Transformer2DModel": ("ideogram4",),
    "JoyImageEditPlusTransformer3DModel": ("joyimage",),
    "JoyImageEditTransformer3DModel": ("joyimage",),
    "Kandinsky5Transformer3DModel": ("kandinsky5",),
    "Kandinsky6SRTransformer3DModel": ("kandinsky6",),
    "Kandinsky6Transformer3DModel": ("kandinsky6",),
    "Krea2Transformer2DModel": ("krea2",),
    "LTX2VideoTransformer3DModel": ("ltx2",),
    "LTXVideoTransformer3DModel": ("ltx",),
    "LatteTransformer3DModel": ("latte",),
    "LongCatImageTransformer2DModel": ("longcat_image",),
    "Lumina2Transformer2DModel": ("lumina2",),
    "LuminaNextDiT2DModel": ("lumina",),
    "MiniMaxH3Transformer3DModel": (),
    "MochiTransformer3DModel": ("mochi",),
    "MotifVideoTransformer3DModel": ("motif_video",),
    "NucleusMoEImageTransformer2DModel": ("nucleusmoe_image",),
    "OmniGenTransformer2DModel": ("omnigen",),
    "OvisImageTransformer2DModel": ("ovis_image",),
    "PRXTransformer2DModel": ("prx",),
    "PixArtTransformer2DModel": ("pixart_alpha", "pixart_sigma"),
    "QwenImage21Transformer2DModel": ("qwenimage21",),
    "QwenImageTransformer2DModel": ("qwenimage",),
    "SD3Transformer2DModel": ("stable_diffusion_3",),
    "SanaTransformer2DModel": ("sana",),
    "SanaVideoTransformer3DModel": ("sana_video",),
    "SanaWMLTX2RefinerTransformer3DModel": ("sana_wm",),
    "SanaWMTransformer3DModel": ("sana_wm",),
    "SkyReelsV2Transformer3DModel": ("skyreels_v2",),
    "WanAnimate2Transformer3DModel": ("wan",),
    "WanAnimateTransformer3DModel": ("wan",),
    "WanTransformer3DModel": ("wan",),
    "WanVACETransformer3DModel": ("wan",),
    "ZImageTransformer2DModel": ("z_image",),
}


@dataclass(frozen=True)
class Coverage:
    """Where ToMe stands on one diffusers transformer class.

    Attributes:
        name: the class's name.
        family: the name of the family that merges in it, or None.
        reason: why ToMe refuses it, or None.
        pipelines: the pipeline folders that build it.
        cp_plan: whether diffusers ships a context-parallel plan for it (`_cp_plan`).
        presets: where its family's presets come from (`presets_source`); "" where refused.
    """

    name: str
    family: str | None
    reason: str | None
    pipelines: tuple[str, ...]
    cp_plan: bool
    presets: str = ""

    @property
    def undecided(self) -> bool:
        """Neither merged nor refused: a class no family or reason is declared for (a diffusers release newer than
        this library's)."""
        return self.family is None and self.reason is None


def presets_source(family: type[Family]) -> str:
    """Where `family`'s presets come from: `"measured"` on a trained model of its shape, or the measured family it
    borrows them from.

    Example:
        >>> presets_source(FAMILIES["flux"]), presets_source(FAMILIES["chroma"])
        ('measured', "FLUX.1's, borrowed")
    """
    if family.name in MEASURED_PRESETS:
        return "measured"
    for origin in MEASURED_PRESETS:
        if family.presets == FAMILIES[origin].presets:
            return f"{_NAMES[origin]}'s, borrowed"
    return "its own, not measured"


#: How the measured families are named in `presets_source`.
_NAMES = {"unet": "the UNets", "pixart": "PixArt", "sd3": "SD3", "flux": "FLUX.1", "wan": "Wan"}


def family_for_class(cls: type) -> type[Family] | None:
    """The family whose `model_class` is `cls` or a base of it (the first `find_family` tries), or None."""
    for family in FAMILIES.values():
        if family.model_class is not None and issubclass(cls, family.model_class):
            return family
    return None


def _classes() -> list[type]:
    found = (getattr(transformers, name) for name in dir(transformers))
    return sorted(
        (
            c
            for c in found
            if isinstance(c, type) and issubclass(c, ModelMixin) and c.__name__ not in NOT_IMAGE_OR_VIDEO
        ),
        key=lambda c: c.__name__,
    )


def coverage() -> list[Coverage]:
    """Every image and video transformer class of the installed diffusers, in name order."""
    rows = []
    for cls in _classes():
        family = family_for_class(cls)
        reason = next((why for refused, why in REFUSED.items() if issubclass(cls, refused)), None)
        rows.append(
            Coverage(
                cls.__name__,
                family.name if family is not None else None,
                reason if family is None else None,
                PIPELINES.get(cls.__name__, ()),
                bool(getattr(cls, "_cp_plan", None)),
                presets_source(family) if family is not None else "",
            )
        )
    return rows


def coverage_table() -> str:
    """`coverage()` as the markdown table docs/families.md carries.

    Example:
        >>> coverage_table().splitlines()[0]
        '| class | ToMe | presets | pipelines | CP plan |'
    """
    lines = ["| class | ToMe | presets | pipelines | CP plan |", "|---|---|---|---|---|"]
    for row in coverage():
        stand = f"merges: `{row.family}`" if row.family else f"refused: {row.reason}" if row.reason else "undecided"
        pipelines = ", ".join(row.pipelines) or "(none yet)"
        presets = row.presets or "-"
        lines.append(f"| `{row.name}` | {stand} | {presets} | {pipelines} | {'yes' if row.cp_plan else '-'} |")
    return "\n".join(lines)
