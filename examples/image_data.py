"""The images examples/resnet_pipeline.py trains on, held in memory: scikit-learn's digits,
synthetic gratings or an ImageFolder directory, split into train/eval and served as whole
steps of micro-batches (the same on every rank)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


@dataclass
class ImageSet:
    """A labelled image set held in memory: ``images`` uint8 N x 3 x S x S (a quarter of
    float32's bytes), ``labels`` int64 N, ``classes`` their names, ``mean``/``std`` per
    channel in [0, 1] for normalising."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised float32 images and labels of the samples ``index``."""
        mean = torch.tensor(self.mean).view(3, 1, 1)
        std = torch.tensor(self.std).view(3, 1, 1)
        return (self.images[index].float() / 255 - mean) / std, self.labels[index]


def _to_uint8_rgb(gray: torch.Tensor, image_size: int) -> torch.Tensor:
    """N x H x W floats in [0, 1] -> N x 3 x S x S uint8, bilinearly resized."""
    x = torch.nn.functional.interpolate(
        gray.unsqueeze(1), size=(image_size, image_size), mode="bilinear", align_corners=False
    )
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()


def _with_stats(images: torch.Tensor, labels: torch.Tensor, classes: list[str]) -> ImageSet:
    """An ImageSet normalised by its own per-channel mean and std."""
    x = images.float() / 255
    mean = tuple(x.mean(dim=(0, 2, 3)).tolist())
    std = tuple(x.std(dim=(0, 2, 3)).clamp_min(1e-3).tolist())
    return ImageSet(images, labels, classes, mean, std)


def digits_set(image_size: int) -> ImageSet:
    """scikit-learn's 1797 handwritten digits (8x8, 17 grey levels), upsampled; ships with
    scikit-learn, so it works offline."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SystemExit("--data digits needs scikit-learn; try --data synthetic") from exc
    digits = load_digits()
    gray = torch.tensor(digits.images, dtype=torch.float32) / 16
    labels = torch.tensor(digits.target, dtype=torch.int64)
    return _with_stats(_to_uint8_rgb(gray, image_size), labels, [str(c) for c in range(10)])


def synthetic_set(image_size: int, n: int = 2000, classes: int = 10, seed: int = 0) -> ImageSet:
    """Deterministic gratings: class c has orientation c*pi/classes and one of three
    frequencies; phase, contrast and pixel noise are random, so the pattern must be learnt."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (n,), generator=g)

    def per_image(values: torch.Tensor) -> torch.Tensor:
        return values.view(-1, 1, 1)

    coords = torch.linspace(-1, 1, 16)
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    angle = per_image(labels * math.pi / classes)
    freq = per_image(1.5 + (labels % 3))
    phase = per_image(torch.rand(n, generator=g) * 2 * math.pi)
    contrast = per_image(0.2 + 0.3 * torch.rand(n, generator=g))
    wave = torch.sin(math.pi * freq * (x * angle.cos() + y * angle.sin()) + phase)
    gray = 0.5 + contrast * wave + 0.1 * torch.randn(n, 16, 16, generator=g)
    names = [f"grating{c}" for c in range(classes)]
    return _with_stats(_to_uint8_rgb(gray, image_size), labels, names)


def image_folder_set(root: str | Path, image_size: int) -> ImageSet:
    """ImageFolder layout ``root/<class>/<image>``: classes are the sorted folder names;
    every image is converted to RGB, resized to ``image_size`` squared and held in memory
    as uint8 (mini-ImageNet's 60000 images at 84 px: 1.3 GB). Normalised with ImageNet's
    statistics, which torchvision weights expect."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise SystemExit("an image folder needs Pillow (pip install pillow)") from exc
    classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    images, labels = [], []
    for label, name in enumerate(classes):
        for path in sorted((Path(root) / name).iterdir()):
            if path.suffix.lower() in IMAGE_SUFFIXES:
                with Image.open(path) as image:
                    rgb = image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
                images.append(torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8))
                labels.append(label)
    if not images:
        raise SystemExit(f"no images under {root}/<class>/ ({', '.join(sorted(IMAGE_SUFFIXES))})")
    pixels = torch.stack(images).view(-1, image_size, image_size, 3).permute(0, 3, 1, 2)
    return ImageSet(pixels.contiguous(), torch.tensor(labels), classes, IMAGENET_MEAN, IMAGENET_STD)


def load_data(source: str, image_size: int) -> ImageSet:
    """``digits``, ``synthetic`` or an ImageFolder directory."""
    if source == "digits":
        return digits_set(image_size)
    if source == "synthetic":
        return synthetic_set(image_size)
    return image_folder_set(source, image_size)


def split(n: int, eval_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffled sample indices, (train, eval); the same on every rank."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held_out = int(n * eval_fraction)
    return order[held_out:], order[:held_out]


class StepBatches:
    """Endless step batches: ``next()`` gives ``m`` micro-batches of ``size`` training
    samples, epoch by epoch in a seeded order -- identical on every rank, so the rank with
    the inputs and the rank with the targets agree on every micro-batch."""

    def __init__(self, data: ImageSet, index: torch.Tensor, m: int, size: int, seed: int):
        if len(index) < m * size:
            raise SystemExit(f"{len(index)} training images cannot fill one step of {m}x{size}")
        self.data, self.index, self.m, self.size = data, index, m, size
        self.generator = torch.Generator().manual_seed(seed)
        self.order, self.pos = torch.empty(0, dtype=torch.int64), 0

    def next(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.pos + self.m * self.size > len(self.order):  # new epoch; drop the tail
            self.order = self.index[torch.randperm(len(self.index), generator=self.generator)]
            self.pos = 0
        xs, ys = [], []
        for _ in range(self.m):
            x, y = self.data.batch(self.order[self.pos : self.pos + self.size])
            xs.append(x)
            ys.append(y)
            self.pos += self.size
        return xs, ys
