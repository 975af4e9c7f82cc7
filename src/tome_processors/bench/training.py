"""One LoRA training step on a UNet, as diffusers' text-to-image LoRA example takes it: `tome-processors bench --train`.

`add_lora` puts a peft LoRA on the attention projections (`to_q`, `to_k`, `to_v`, `to_out.0`) with
`unet.add_adapter`, the base weights frozen, as `train_text_to_image_lora.py` does. `TrainingStep` is one
optimizer step on fixed latents and text: noise and timesteps drawn per step from a seeded generator
(timesteps uniform over the schedule, one per sample), `DDPMScheduler.add_noise`, the UNet's noise
prediction, MSE against the noise, backward, AdamW. Under a float16 or bfloat16 `dtype` the base weights
are in that dtype, the LoRA weights in float32 and the forward runs under `torch.autocast` (float16 with
a `GradScaler`), as the example does with `--mixed_precision`.

Example:
    >>> from tome_processors.bench.unet import build_unet, make_inputs
    >>> unet = build_unet("tiny")
    >>> step = TrainingStep(unet, make_inputs(unet, batch=2, resolution=64), seed=0)
    >>> loss = step(unet)  # one optimizer step of the LoRA
    >>> loss.shape, len(step.params) > 0
    (torch.Size([]), True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from diffusers import DDPMScheduler

from .unet import UNetInputs

__all__ = ["LORA_TARGETS", "TrainingStep", "add_lora", "gradient_change", "lora_parameters", "training_scheduler"]

#: The modules diffusers' text-to-image LoRA example adapts: the attention projections.
LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")


def training_scheduler() -> DDPMScheduler:
    """Stable Diffusion's training noise schedule (scaled linear betas 0.00085 to 0.012, 1000 steps).

    Example:
        >>> training_scheduler().config.num_train_timesteps
        1000
    """
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def add_lora(
    unet: torch.nn.Module, rank: int = 4, seed: int = 0, init: bool | str = "gaussian"
) -> list[torch.nn.Parameter]:
    """Freeze `unet` and add a LoRA of `rank` on its attention projections; returns the trainable parameters.

    As diffusers' example: `LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
    target_modules=["to_q", "to_k", "to_v", "to_out.0"])` through `unet.add_adapter`. The LoRA weights are
    drawn from `seed` without touching the global RNG; `init=False` makes the up-projections random too
    (peft's default sets them to zero, so the first step has no gradient for the down-projections).

    Example:
        >>> from tome_processors.bench.unet import build_unet
        >>> unet = build_unet("tiny")
        >>> params = add_lora(unet)
        >>> sum(p.numel() for p in params) < sum(p.numel() for p in unet.parameters())
        True
    """
    from peft import LoraConfig

    if not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"Expected rank to be an integer >= 1, but got {rank!r}.")
    unet.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=init, target_modules=list(LORA_TARGETS))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet.add_adapter(config)
    params = lora_parameters(unet)
    if not params:
        raise ValueError(f"Expected attention projections {LORA_TARGETS} in {type(unet).__name__}, but found none.")
    return params


def lora_parameters(unet: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trainable (LoRA) parameters of `unet`, in `named_parameters` order, cast to float32 in place.

    Example:
        >>> lora_parameters(torch.nn.Linear(2, 2).requires_grad_(False))
        []
    """
    params = [p for _, p in unet.named_parameters() if p.requires_grad]
    for p in params:  # trainable weights stay in float32 under mixed precision (diffusers' cast_training_params)
        p.data = p.data.float()
    return params


class TrainingStep:
    """One LoRA optimizer step on fixed latents and text, with noise and timesteps drawn per step.

    Calling it with a UNet (the one it was built for, or a shared-weight copy) runs one step and returns the
    loss, detached. `gradients(unet)` computes the LoRA gradients of one fixed draw without stepping.

    Args:
        unet: the UNet, LoRA added (`add_lora`) or not (then it is added here with `rank` and `seed`).
        inputs: the batch: `inputs.sample` is taken as the clean latents, with its text embeddings (and SDXL's
            added conditions); its timestep is not used.
        seed: seeds the noise and timesteps of the steps (one generator, drawn from step after step).
        lr: AdamW's learning rate (diffusers' example: 1e-4).
        rank: the LoRA rank when it is added here.
        gradient_checkpointing: switches the UNet's gradient checkpointing on (True) or off (False) at
            every call; None leaves it as it is.

    Example:
        >>> from tome_processors.bench.unet import build_unet, make_inputs
        >>> unet = build_unet("tiny")
        >>> step = TrainingStep(unet, make_inputs(unet, 2, 64))
        >>> sorted(step.gradients(unet))[:1]  # doctest: +ELLIPSIS
        ['down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora_A.default.weight']
    """

    def __init__(
        self,
        unet: torch.nn.Module,
        inputs: UNetInputs,
        seed: int = 0,
        lr: float = 1e-4,
        rank: int = 4,
        gradient_checkpointing: bool | None = None,
    ) -> None:
        if not any(p.requires_grad for p in unet.parameters()) or not getattr(unet, "peft_config", None):
            add_lora(unet, rank=rank, seed=seed)
        self.params = lora_parameters(unet)
        self.names = [name for name, p in unet.named_parameters() if p.requires_grad]
        self.inputs = inputs
        self.scheduler = training_scheduler()
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.gradient_checkpointing = gradient_checkpointing
        self.optimizer = torch.optim.AdamW(self.params, lr=lr)
        self.device = inputs.sample.device
        self.dtype = inputs.sample.dtype
        mixed = self.dtype in (torch.float16, torch.bfloat16)
        self.autocast = mixed
        scaled = self.dtype == torch.float16 and self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler(self.device.type) if scaled else None

    def _draw(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        latents = self.inputs.sample
        noise = torch.randn(latents.shape, generator=generator).to(self.device, self.dtype)
        steps = self.scheduler.config.num_train_timesteps
        timesteps = torch.randint(0, steps, (latents.shape[0],), generator=generator).to(self.device)
        return noise, timesteps

    @contextlib.contextmanager
    def _mode(self, unet: torch.nn.Module) -> Iterator[None]:
        was_training = unet.training
        unet.train()
        if self.gradient_checkpointing is not None:
            if self.gradient_checkpointing:
                unet.enable_gradient_checkpointing()
            else:
                unet.disable_gradient_checkpointing()
        try:
            yield
        finally:
            unet.train(was_training)

    def loss(self, unet: torch.nn.Module, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """The noise-prediction MSE of one draw (in float32, as the example computes it)."""
        inputs = self.inputs
        noisy = self.scheduler.add_noise(inputs.sample, noise, timesteps)
        cast = torch.autocast(self.device.type, self.dtype) if self.autocast else contextlib.nullcontext()
        with cast:
            prediction = unet(
                noisy,
                timesteps,
                encoder_hidden_states=inputs.encoder_hidden_states,
                added_cond_kwargs=inputs.added_cond_kwargs,
            ).sample
        return torch.nn.functional.mse_loss(prediction.float(), noise.float())

    def __call__(self, unet: torch.nn.Module) -> torch.Tensor:
        """One optimizer step: draw, forward, loss, backward, AdamW; returns the loss (detached)."""
        noise, timesteps = self._draw(self.generator)
        with self._mode(unet):
            loss = self.loss(unet, noise, timesteps)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def gradients(self, unet: torch.nn.Module, seed: int | None = None) -> dict[str, torch.Tensor]:
        """The LoRA gradients (float32, by parameter name) of one draw from `seed` (default: the step's seed + 1).

        Nothing is stepped: the weights stay as they are and the gradients are cleared again.
        """
        generator = torch.Generator().manual_seed(self.seed + 1 if seed is None else seed)
        noise, timesteps = self._draw(generator)
        with self._mode(unet):
            self.optimizer.zero_grad(set_to_none=True)
            self.loss(unet, noise, timesteps).backward()
            named = dict(unet.named_parameters())
            grads = {}
            for name in self.names:
                grad = named[name].grad
                grads[name] = torch.zeros_like(named[name]) if grad is None else grad.detach().float().clone()
            self.optimizer.zero_grad(set_to_none=True)
        return grads


def gradient_change(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """`||g - g_ref|| / ||g_ref||` over all LoRA gradients together, in float64.

    Example:
        >>> gradient_change({"a": torch.tensor([3.0, 4.0])}, {"a": torch.tensor([3.0, 0.0])})
        1.3333333333333333
    """
    if grads.keys() != reference.keys():
        raise ValueError(f"Expected gradients of the same parameters, but got {len(grads)} and {len(reference)} names.")
    diff = sum(float((grads[k].double() - reference[k].double()).square().sum()) for k in reference)
    norm = sum(float(reference[k].double().square().sum()) for k in reference)
    return (diff / max(norm, 1e-300)) ** 0.5
