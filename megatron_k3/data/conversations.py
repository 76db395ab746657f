"""data=chat: conversations in K3's chat format, packed whole into samples, the loss on the assistant's tokens only.

Legend: T sequence length (train.seq_length).

A conversation is one JSON line (`ChatJsonl`, paths relative to the file) or one of the embedded set's
(chat_set.EmbeddedChats):

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": str | [parts], ...}, ...],
     "tools": [...]?, "thinking": bool?, "thinking_effort": str | null?}

OpenAI-style messages: content a string or parts {"type": "text", "text": ...} / {"type": "image_url",
"image_url": {"url": PATH}}; an assistant message may carry "reasoning_content" and "tool_calls" ([{"id",
"function": {"name", "arguments"}}]), a tool message its "tool_call_id". Tokens and mask: chat.encode_chat, exactly
the release's chat template with its assistant mask; an image's placeholder becomes `<|media_begin|>`, one
`model.vision.placeholder_token_id` per feature row and `<|media_end|>` (media_tokens.py), its pixels go through
data=multimodal's preprocessing. Whole conversations are packed into samples of T + 1 tokens with document
boundaries (multimodal.MultimodalDataset's packing and order: sample c of the run is a pure function of (seed, c)).

Bad conversations follow data.on_bad_sample (skip: logged once, left out; stop: DataError naming file:line): not
JSON, no messages, an unknown role, a malformed part or tool call, no assistant turn, a tool result whose call no
earlier assistant message made, a missing image, images for a model without a vision tower, or more tokens than a
sample holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import BadDocument, ConfigError
from .chat import chat_images, encode_conversation
from .chat_set import EmbeddedChats
from .documents import JsonlDocuments
from .media_tokens import media_tokens_of
from .multimodal import MultimodalDataset, jsonl_sources, media_processor, split_sources

__all__ = ["ROLES", "ChatJsonl", "ChatDataset", "build_chat_datasets", "chat_options", "check_conversation",
           "expand_images", "images_of"]

ROLES = ("system", "user", "assistant", "tool")
_TOP = {"messages": list, "tools": list, "thinking": bool, "thinking_effort": (str, type(None))}


def _check_content(k: int, content) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadDocument(f"message {k}: content must be a string or a list of parts, got {type(content).__name__}")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image_url" and part.get("image_url") is not None:
            continue
        raise BadDocument(f"message {k}: a content part must be {{'type': 'text', 'text': str}} or {{'type': "
                          f"'image_url', 'image_url': {{'url': ...}}}}, got {json.dumps(part, default=str)[:80]}")


def _check_calls(k: int, m: dict, calls: set) -> None:
    for call in m.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadDocument(f"message {k}: a tool call needs {{'function': {{'name': ..., 'arguments': ...}}}}")
        if call.get("id") is not None:
            calls.add(str(call["id"]))


def check_conversation(conv) -> None:
    """BadDocument naming the first problem that makes `conv` unusable for training."""
    if not isinstance(conv, dict):
        raise BadDocument(f"expected a JSON object with \"messages\", got {type(conv).__name__}")
    for key, kind in _TOP.items():
        if conv.get(key) is not None and not isinstance(conv[key], kind):
            raise BadDocument(f"\"{key}\" has the wrong type ({type(conv[key]).__name__})")
    msgs = conv.get("messages")
    if not msgs:
        raise BadDocument("no \"messages\"")
    calls, assistant = set(), False
    for k, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise BadDocument(f"message {k}: unknown role {role!r} (valid: {', '.join(ROLES)})")
        _check_content(k, m.get("content"))
        if role == "assistant":
            assistant = True
            _check_calls(k, m, calls)
        elif role == "tool":
            call_id = m["tool_call_id"] if "tool_call_id" in m else m.get("id")  # none: named by its position
            if call_id is not None and str(call_id) not in calls:
                raise BadDocument(f"message {k}: a tool result for call {call_id!r}, which no earlier assistant "
                                  "message made")
    if not assistant:
        raise BadDocument("no assistant turn: nothing to learn")


def chat_options(conv: dict) -> dict:
    """encode_chat's keyword arguments of a conversation: "thinking" (absent or null: true) and "thinking_effort"
    (absent: max; null: no effort line)."""
    thinking = conv.get("thinking")
    return {"thinking": True if thinking is None else bool(thinking),
            "thinking_effort": conv.get("thinking_effort", "max")}


def images_of(conv: dict) -> list:
    """The image handles of a conversation's image parts, in the order the chat template renders them (tool results
    are put in the order of their calls); BadDocument for a part that names no image."""
    try:
        return chat_images(conv["messages"], conv.get("tools"))
    except ValueError as e:
        raise BadDocument(str(e)) from None


class ChatJsonl(JsonlDocuments):
    """The conversations of one JSONL file (one per non-blank line); image URLs are paths relative to the file
    (or file:// URLs)."""

    def _image_path(self, url) -> str:
        if not isinstance(url, str) or not url:
            raise BadDocument(f"an image_url must be a non-empty path, got {url!r}")
        if url.startswith("file://"):
            url = url[len("file://"):]
        elif "://" in url or url.startswith("data:"):
            raise BadDocument(f"image {url[:60]!r}: only local files are read (no download); give a path")
        return str(self.base / Path(url))

    def conversation(self, i: int) -> dict:
        try:
            conv = json.loads(self._line(i))
        except ValueError as e:
            raise BadDocument(f"not valid JSON ({e})") from None
        check_conversation(conv)
        for m in conv["messages"]:
            for part in m.get("content") if isinstance(m.get("content"), list) else ():
                if part.get("type") == "image_url":
                    img = part["image_url"]
                    part["image_url"] = {"url": self._image_path(img.get("url") if isinstance(img, dict) else img)}
        return conv


class ChatDataset(MultimodalDataset):
    """Samples of T + 1 tokens, each a whole number of conversations of `source` (ChatJsonl, EmbeddedChats), with
    their assistant-token loss mask and media. `media_tokens` and `processor` are None for a text model; `pad_id`
    fills the rest of a sample (its labels are ignored)."""

    def __init__(self, source, doc_ids, seq_length: int, seed: int, *, tokenizer, media_tokens, processor,
                 pad_id: int, on_bad_sample: str = "skip", name: str = "chat", report: bool = True):
        self.tokenizer, self._pad_id = tokenizer, int(pad_id)
        super().__init__(source, doc_ids, seq_length, seed, encode=None, eod_id=None, media_tokens=media_tokens,
                         processor=processor, on_bad_sample=on_bad_sample, name=name, report=report)
        self.reads_files = processor is not None and isinstance(source, ChatJsonl)

    @property
    def tokens(self):
        return self._media_tokens

    @tokens.setter
    def tokens(self, media_tokens):  # MultimodalDataset keeps its media ids here; a text model has none
        self._media_tokens = media_tokens if media_tokens is not None else _NoMedia(self._pad_id)

    def _conversation(self, i: int) -> dict:
        conv = self.source.conversation(int(i))
        check_conversation(conv)
        return conv

    def _media(self, i: int) -> tuple:
        return None, [("image", [h]) for h in images_of(self._conversation(i))]

    def _structure(self, i: int) -> tuple:
        """(the conversation, its images' grids [n][1]); BadDocument for what the model could not take."""
        conv = self._conversation(i)
        images = images_of(conv)
        if images and self.processor is None:
            raise BadDocument(f"{len(images)} image(s), but the model has no vision tower (model.vision.enabled)")
        return conv, (super()._structure(i)[1] if images else [])

    def _encoded(self, structs: list):
        return None  # every conversation is encoded whole by _tokens_of

    def _tokens_of(self, i: int, conv: dict, media: list, encoded):
        """(tokens, kept length, media count, grids, media count, loss mask) of conversation i; None: left out."""
        grids = [g for marker in media for g in marker]
        try:
            c = encode_conversation(self.tokenizer, conv["messages"], conv.get("tools"), **chat_options(conv))
            ids, mask = self._expand_media(c.ids, c.loss_mask, c.image_spans, grids)
        except BadDocument as e:
            self._bad(i, str(e))
            return None
        except (ValueError, KeyError, TypeError) as e:
            self._bad(i, f"the chat template rejects it: {e}")
            return None
        mask[0] = 0  # the first token is no label of this conversation (it follows another one, or nothing)
        cap = self.seq_length + 1
        if len(ids) > cap:
            self._bad(i, f"the conversation needs {len(ids)} tokens, more than a sample of train.seq_length+1="
                         f"{cap} (raise train.seq_length, or split it)")
            return None
        if not any(mask):
            self._bad(i, "no assistant tokens to learn")
            return None
        return ids, len(ids), len(grids), grids, len(grids), np.asarray(mask, dtype=bool)

    def _expand_media(self, ids: list, mask: list, spans: list, grids: list) -> tuple:
        if len(spans) != len(grids):
            raise BadDocument(f"{len(grids)} images but {len(spans)} image placeholders in the rendered chat")
        return expand_images(ids, mask, spans, [self.processor.num_tokens(g) for g in grids], self.tokens)


def expand_images(ids: list, mask: list, spans: list, rows: list, tokens) -> tuple:
    """(ids, mask) with each image's placeholder ids (its [start, end) span) replaced by `<|media_begin|>`, one
    placeholder per feature row (`rows` of each image) and `<|media_end|>` (MediaTokens `tokens`), none learned."""
    out, out_mask, prev = [], [], 0
    for (start, end), n in zip(spans, rows):
        run = [tokens.begin] + [tokens.placeholder] * int(n) + [tokens.end]
        out += ids[prev:start] + run
        out_mask += mask[prev:start] + [0] * len(run)
        prev = end
    return out + ids[prev:], out_mask + mask[prev:]


class _NoMedia:
    """A text model's stand-in for MediaTokens: no media ids, `pad` for the rest of a sample."""

    def __init__(self, pad: int):
        self.pad = pad
        self.ids = (pad,)


def build_chat_datasets(run, paths: list, tokenizer, pad_id: int, report: bool = True) -> tuple:
    """(train, valid) for data=chat: `paths` [(weight, JSONL path)] (empty: the embedded chat set), split by
    data.split, blended by weight; `tokenizer` one with K3's control tokens (data/tokenizer.py); `pad_id` fills
    the rest of a sample."""
    d, m = run.data, run.model
    need = max([tokenizer.get_vocab_size()] + [i + 1 for i in tokenizer.special_tokens.values()])
    if need > m.vocab_size:
        raise ConfigError("model.vocab_size", m.vocab_size, f"must be >= {need}: the chat tokenizer's ids (its "
                          f"vocabulary and K3's control tokens)")
    tokens = media_tokens_of(m, tokenizer, pad_id) if m.vision.enabled else None
    processor = media_processor(run) if m.vision.enabled else None
    sources = jsonl_sources(paths, ChatJsonl) if paths else [(1.0, EmbeddedChats(vision=m.vision.enabled))]
    return split_sources(run, sources, lambda src, ids, name: ChatDataset(
        src, ids, run.train.seq_length, run.train.seed, tokenizer=tokenizer, media_tokens=tokens,
        processor=processor, pad_id=pad_id, on_bad_sample=d.on_bad_sample, name=name, report=report))
