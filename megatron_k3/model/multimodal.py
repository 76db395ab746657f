"""K3ForConditionalGeneration: the K3 language model with its vision tower and projector (model/vision.py).

Legend: B batch, S / T tokens, N feature rows, M media, K hidden.

`model(input_ids, pixel_values=..., grid_thws=...)`: the media's features (`vision_features`, [N, K]) take the
place of the `model.vision.placeholder_token_id` tokens in `input_ids`, in order (row-major over the batch).
Two forms of `input_ids` are accepted:
- compact (NeMo AutoModel's kimi_k3 convention): ONE placeholder per medium, expanded here into that medium's
  feature rows, so the logits are [B, S - M + N, V]. Rows whose expansions differ in length are right-padded with
  token 0 (label -100). Not with cu_seqlens (expand first).
- expanded (Kimi K2.5's, and what data=multimodal makes): one placeholder per feature row; the length is kept.
Any other placeholder count is an error naming both counts. Labels of a compact input move with their tokens (a
placeholder's label goes to its last feature row; feature rows otherwise get -100).

The tower and projector sit with the embedding. This is single-device code: how they run distributed (their work
split by media, the features gathered, their gradients summed, the features of a sequence share under sequence
parallelism) is applied from outside by parallel/tensor.py's `_vision`; docs/vision.md explains the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import InferenceCache
from .k3 import CausalLMOutput, K3ForCausalLM
from .vision import MoonViT3d, PatchMergerV2, check_media, num_features

__all__ = ["K3ForConditionalGeneration", "MediaRows", "expand_placeholders", "causal_lm_class"]

PAD_TOKEN_ID = 0  # K3's pad_token_id


def expand_placeholders(input_ids: torch.Tensor, labels: torch.Tensor | None, counts: list, placeholder: int):
    """Compact -> expanded form: the k-th placeholder (row-major) repeated counts[k] times; rows right-padded with
    token 0 to the longest. Returns (input_ids, labels or None)."""
    rows, label_rows, k = [], [], 0
    for b in range(input_ids.shape[0]):
        ids, lab = [], []
        row = input_ids[b].tolist()
        row_labels = labels[b].tolist() if labels is not None else [0] * len(row)
        for tok, lbl in zip(row, row_labels):
            if tok == placeholder:
                ids += [placeholder] * counts[k]
                lab += [-100] * (counts[k] - 1) + [lbl]
                k += 1
            else:
                ids.append(tok)
                lab.append(-100 if lbl == placeholder else lbl)
        rows.append(ids)
        label_rows.append(lab)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [PAD_TOKEN_ID] * (width - len(r)) for r in rows], dtype=input_ids.dtype,
                       device=input_ids.device)
    if labels is None:
        return ids, None
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in label_rows], dtype=labels.dtype, device=labels.device)
    return ids, lab


@dataclass
class MediaRows:
    """The vision features of a batch laid out as its token embeddings: `rows` [B, T, K] holds feature rows at the
    placeholder positions `mask` [B, T] (zeros elsewhere); called on the embeddings h [B, T, K] it puts them in."""
    rows: torch.Tensor
    mask: torch.Tensor

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask.unsqueeze(-1), self.rows.to(h.dtype), h)


@dataclass
class _TouchTower:
    """A batch without media: the embeddings plus zero times the tower's parameters, so that they take part in the
    backward (with a zero gradient) whatever a replica's batch holds."""
    touch: torch.Tensor | float

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h + 0.0 * self.touch if torch.is_tensor(self.touch) else h


class K3ForConditionalGeneration(K3ForCausalLM):
    """K3ForCausalLM plus `vision_tower` (MoonViT3d) and `mm_projector` (PatchMergerV2) on the model part that holds
    the embedding (None elsewhere). See the module docstring for the inputs."""

    def __init__(self, cfg, init: bool = True, *, layers: range | None = None, embedding: bool = True,
                 head: bool = True):
        if not cfg.vision.enabled:
            raise ValueError("model.vision.enabled is false: build K3ForCausalLM")
        super().__init__(cfg, init=False, layers=layers, embedding=embedding, head=head)
        self.vision_tower = MoonViT3d(cfg.vision) if embedding else None
        self.mm_projector = PatchMergerV2(cfg.vision, cfg.hidden_size) if embedding else None
        if cfg.freeze_vision:
            self.freeze_vision()
        if init:
            self.reset_parameters()

    def vision_parameters(self) -> list:
        return [p for m in (self.vision_tower, self.mm_projector) if m is not None for p in m.parameters()]

    def freeze_vision(self, frozen: bool = True) -> None:
        """The tower and projector take no gradient (model.freeze_vision): the optimizer leaves them out."""
        for p in self.vision_parameters():
            p.requires_grad_(not frozen)

    def vision_features(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor) -> torch.Tensor:
        """[N, K]: the projected features of the media, in order (N = sum of (h/2)(w/2) over the media)."""
        if self.vision_tower is None:
            raise ValueError("this model part has no vision tower (only the first pipeline stage takes media)")
        grids = check_media(pixel_values, grid_thws, self.cfg.vision)
        return self.mm_projector(self.vision_tower(pixel_values, grids))

    def _media(self, input_ids, labels, cu_seqlens, pixel_values, grid_thws):
        """(input_ids, labels, what to do to the token embeddings: MediaRows) for one call with media."""
        v = self.cfg.vision
        grids = check_media(pixel_values, grid_thws, v)
        if not grids:  # a batch without media: the tower takes part with a zero gradient (every replica reduces
            # the same gradients whatever its batch holds)
            return input_ids, labels, _TouchTower(sum(p.reshape(-1)[0] for p in self.vision_parameters()
                                                      if p.requires_grad))
        counts = num_features(grids, v)
        n, m = sum(counts), len(counts)
        found = int((input_ids == v.placeholder_token_id).sum())
        if found != n:
            if found == m and cu_seqlens is None:
                input_ids, labels = expand_placeholders(input_ids, labels, counts, v.placeholder_token_id)
            else:
                raise ValueError(
                    f"input_ids hold {found} placeholder tokens (model.vision.placeholder_token_id="
                    f"{v.placeholder_token_id}), matching neither the {m} media (one per medium) nor their {n} "
                    f"feature rows (one per row)" + (" (the one-per-medium form is not taken with cu_seqlens)"
                                                      if found == m else ""))
        features = self.mm_projector(self.vision_tower(pixel_values, grids))
        slots = input_ids == v.placeholder_token_id
        rows = features.new_zeros(slots.shape + (features.shape[-1],)).masked_scatter(slots.unsqueeze(-1), features)
        return input_ids, labels, MediaRows(rows, slots)

    def forward(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cache: InferenceCache | None = None,
                return_logits: bool | None = None, state_in=None, pixel_values: torch.Tensor | None = None,
                grid_thws: torch.Tensor | None = None) -> CausalLMOutput:
        """K3ForCausalLM.forward plus the media: pixel_values [L, 3, p, p] and grid_thws [M, 3] (model/vision.py);
        input_ids in the compact or the expanded form (module docstring)."""
        media = None
        if pixel_values is not None:
            if self.vision_tower is None:
                raise ValueError("pixel_values given to a pipeline stage without the vision tower (only the first "
                                 "stage takes media)")
            if grid_thws is None:
                raise ValueError("pixel_values given without grid_thws")
            input_ids, labels, media = self._media(input_ids, labels, cu_seqlens, pixel_values, grid_thws)
        h = self.model(input_ids, cu_seqlens=cu_seqlens, cache=cache, state_in=state_in, media=media)
        return self._output(h, labels, cache)

    @torch.no_grad()
    def generate_logits(self, input_ids: torch.Tensor, prefill: int, pixel_values: torch.Tensor | None = None,
                        grid_thws: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill the first `prefill` tokens of the expanded input (with the media, which must lie inside them),
        then decode the rest one token at a time (teacher-forced); the logits of every position, [B, T, V]."""
        if pixel_values is None:
            return super().generate_logits(input_ids, prefill)
        pid = self.cfg.vision.placeholder_token_id
        counts = num_features(check_media(pixel_values, grid_thws, self.cfg.vision), self.cfg.vision)
        if int((input_ids == pid).sum()) == len(counts) != sum(counts):
            input_ids, _ = expand_placeholders(input_ids, None, counts, pid)
        if bool((input_ids[:, prefill:] == pid).any()):
            raise ValueError("media placeholders after the prefill: prefill every medium")
        cache = self.new_cache()
        out = [self(input_ids[:, :prefill], cache=cache, return_logits=True, pixel_values=pixel_values,
                    grid_thws=grid_thws).logits]
        for t in range(prefill, input_ids.shape[1]):
            out.append(self(input_ids[:, t:t + 1], cache=cache, return_logits=True).logits)
        return torch.cat(out, dim=1)


def causal_lm_class(cfg) -> type:
    """The model class a config builds: K3ForConditionalGeneration with model.vision.enabled, else K3ForCausalLM."""
    return K3ForConditionalGeneration if cfg.vision.enabled else K3ForCausalLM
