"""Greedy decoding with the KDA / MLA inference cache (model.cache): the prompt is prefilled once, then each new
token is one step of the recurrent KDA form and one query against MLA's cached latents."""

from __future__ import annotations

import torch

__all__ = ["greedy"]


@torch.no_grad()
def greedy(model, prompt_ids: list, stop_ids, max_new_tokens: int, **media) -> list:
    """The ids `model` (K3ForCausalLM or K3ForConditionalGeneration, in eval mode) appends to `prompt_ids` by
    greedy decoding, up to and including the first id in `stop_ids`, at most `max_new_tokens`. `media`
    (pixel_values, grid_thws) go with the prefill of a vision-language model."""
    if not prompt_ids:
        raise ValueError("greedy decoding needs a non-empty prompt")
    stop = {int(s) for s in stop_ids}
    device = next(model.parameters()).device
    cache = model.new_cache()
    x = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    logits = model(x, cache=cache, return_logits=True, **media).logits
    out = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt in stop:
            break
        logits = model(torch.tensor([[nxt]], dtype=torch.long, device=device), cache=cache,
                       return_logits=True).logits
    return out
