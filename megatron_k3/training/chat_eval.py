"""Chat evaluation of a checkpoint in one process (tools/chat.py, make sft): load any checkpoint for inference,
render a prompt in K3's chat format, greedy-decode the reply with the KDA / MLA cache, and the exact-match of held-out
conversations' last assistant turn (docs/sft.md).

Exact-match: the conversation without its last assistant turn is the prompt (the release's generation prompt,
chat.encode_prompt); the model decodes until the end-of-message marker; the reply matches when its ids equal the
ids the chat template renders for the reference turn (its think channel, response and tool calls, token for token).
The answer matches when the ids after the think channel do (`answer_ids`: the response and the tool calls).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..config import DataConfig, ModelConfig, PeftConfig
from ..data.chat import CLOSE, END_OF_MSG, SEP, encode_chat, encode_conversation, encode_prompt
from ..data.conversations import chat_options, expand_images
from ..data.media_tokens import media_tokens_of
from ..data.multimodal import media_processor
from ..interop import load_hf, load_hf_sharded
from ..model.generate import greedy
from ..model.multimodal import causal_lm_class
from ..peft import apply_lora
from . import checkpoint as ckpt

__all__ = ["answer_ids", "load_for_inference", "media_prompt", "reply_ids", "target_ids", "exact_match"]


def load_for_inference(path: str | Path) -> torch.nn.Module:
    """The model of a Hugging Face / K3 directory, or of a training checkpoint (a step directory or a checkpoint
    directory: its newest complete one), in fp32 and eval mode, in this process. A peft=lora checkpoint gives the
    adapted model: its frozen base read from the directory the checkpoint records, the adapters unmerged."""
    path = Path(path)
    if ckpt.is_hf_directory(path):
        return load_hf(path).float().eval()
    try:
        step = ckpt.resolve_load_path(str(path), path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: {e}") from None
    if step is None:
        raise FileNotFoundError(f"{path}: no checkpoint there")
    tensors, _, meta = ckpt.read_full(step, states=False)
    cfg = ModelConfig(**meta["model"])
    model = causal_lm_class(cfg)(cfg, init=False)
    if "peft" in meta:
        _adapted(model, meta, step)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    params = dict(model.named_parameters())
    missing = [k for k in missing if k in params and params[k].requires_grad]  # buffers, a frozen base: read apart
    if missing or unexpected:
        raise ValueError(f"{step}: does not match its model config (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    return model.float().eval()


def _adapted(model, meta: dict, step: Path) -> None:
    """peft=lora: `model` adapted as the run was (its PeftConfig from meta.json) and its frozen base read."""
    peft = PeftConfig(**meta["peft"])
    seed = int(meta.get("seed", 0))
    if not peft.base:
        model.materialize("cpu", seed=seed)  # the run's base was the initialised model of its seed
    apply_lora(model, peft, seed=seed)
    if peft.base:
        load_hf_sharded(model, peft.base, group=None)


def _split(conv: dict) -> tuple:
    """(the messages before the last assistant turn, that turn)."""
    msgs = conv["messages"]
    last = max(k for k, m in enumerate(msgs) if m.get("role") == "assistant")
    return msgs[:last], msgs[last]


def target_ids(tokenizer, conv: dict) -> tuple:
    """(prompt ids, the reference reply's ids) of a conversation's last assistant turn."""
    before, turn = _split(conv)
    kw = chat_options(conv)
    prompt = encode_prompt(tokenizer, before, conv.get("tools"), **kw)
    full, _ = encode_chat(tokenizer, before + [turn], conv.get("tools"), **kw)
    if full[:len(prompt)] != prompt:
        raise ValueError("the generation prompt is not a prefix of the rendered conversation")
    return prompt, full[len(prompt):]


def media_prompt(model, tokenizer, conv: dict, load) -> tuple:
    """(the generation prompt's ids with each image's run of placeholders, the media keyword arguments) of a
    conversation for a vision-language model, preprocessed as data=chat trains (`load(handle)` -> a PIL image)."""
    before, _ = _split(conv)
    c = encode_conversation(tokenizer, before, conv.get("tools"), add_generation_prompt=True, **chat_options(conv))
    if not c.image_spans:
        return c.ids, {}
    processor = media_processor(SimpleNamespace(data=DataConfig(), model=model.cfg))
    patches, grids = zip(*(processor.chunk([load(h)]) for h in c.images))
    ids, _ = expand_images(c.ids, c.loss_mask, c.image_spans, [processor.num_tokens(g) for g in grids],
                           media_tokens_of(model.cfg, tokenizer, pad=0))
    return ids, {"pixel_values": torch.from_numpy(np.concatenate(patches)),
                 "grid_thws": torch.tensor(np.asarray(grids, dtype=np.int64))}


def reply_ids(model, tokenizer, prompt: list, max_new_tokens: int = 64, **media) -> list:
    """The greedy reply to `prompt` (with its media), up to and including the end-of-message marker."""
    return greedy(model, prompt, [tokenizer.token_to_id(END_OF_MSG)], max_new_tokens, **media)


def answer_ids(tokenizer, ids: list, thinking: bool) -> list:
    """A reply's ids after its think channel (the answer: the response and the tool calls), the whole reply when the
    prompt opened the response channel (thinking off) or the think channel never closes."""
    if not thinking:
        return list(ids)
    close, sep = tokenizer.token_to_id(CLOSE), tokenizer.token_to_id(SEP)
    if close not in ids:
        return list(ids)
    k = ids.index(close)
    return list(ids[ids.index(sep, k) + 1:]) if sep in ids[k:] else []


def exact_match(model, tokenizer, conversations, max_new_tokens: int = 64, load=None) -> tuple:
    """(the fraction of `conversations` whose last assistant turn the model reproduces exactly, per-conversation
    rows (prompt ids, reference ids, reply ids)); `load(handle)`: the images of a vision-language model's
    conversations."""
    rows = []
    for conv in conversations:
        prompt, ref = target_ids(tokenizer, conv)
        media = {}
        if load is not None:
            prompt, media = media_prompt(model, tokenizer, conv, load)
        rows.append((prompt, ref, reply_ids(model, tokenizer, prompt, max(max_new_tokens, len(ref)), **media)))
    hits = sum(reply == ref for _, ref, reply in rows)
    return hits / max(len(rows), 1), rows
