"""K3's conversation format: chat messages to token ids and a loss mask, the same ids and mask as the K3 release's
`tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_assistant_tokens_mask=True, thinking=...,
thinking_effort=...)`, and generated ids back to the reply.

The format (XTML) writes every element as `<|open|>tag attr="value"<|sep|> ... <|close|>tag<|sep|>` and ends each
message with `<|end_of_msg|>`:

    [tool declarations]  <|open|>message role="system" type="tool-declare"<|sep|># Tools ... (the tools as JSON)
                         <|close|>message<|sep|><|end_of_msg|>
    [thinking effort]    <|open|>message role="system" type="thinking-effort"<|sep|>... `thinking_effort=max`.
                         <|close|>message<|sep|><|end_of_msg|>          (thinking mode only; max by default)
    user, system         <|open|>message role="user" name="..."<|sep|>content<|close|>message<|sep|><|end_of_msg|>
    assistant            <|open|>message role="assistant"<|sep|>
                           <|open|>think<|sep|>reasoning<|close|>think<|sep|>   (thinking mode: present even if empty)
                           <|open|>response<|sep|>content<|close|>response<|sep|>
                           <|open|>tools<|sep|><|open|>call tool="name" index="1"<|sep|>
                             <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|> ...
                           <|close|>call<|sep|><|close|>tools<|sep|>
                         <|close|>message<|sep|><|end_of_msg|>
    tool result          <|open|>message role="tool" tool="name" index="1"<|sep|>content<|close|>message<|sep|>...

Each run of text and each marker is tokenized on its own (the boundaries decide the ids). Markers are special ids;
message text, names and attribute values are always ordinary text (`"` and `&` escaped in attributes), so a user who
types `<|open|>` or `<|end_of_msg|>` writes text, never structure. Tool results are put in the order of the calls they
answer (by `tool_call_id`). An image content part (`{"type": "image_url", ...}` or `"image"`) becomes the control text
`<|kimi_image_placeholder|>` (the release's tokenizer reads it as ordinary text; a BPE of data/tokenizer.py as the
model's placeholder id); `ChatTokens.image_spans` says where each one's ids are, for the data pipeline to expand into
media tokens. The loss mask is 1 on an assistant message's ids after its opening `<|open|>message role="assistant"
<|sep|>`, through its `<|end_of_msg|>`.

A system message carrying "tools" declares more tools (the release's lazy loading); its content is not rendered.
Not rendered here: the release's tool_choice and response_format system lines (no caller needs them yet).

A conversation the format cannot hold raises ValueError with one line naming the message and the problem. As the
release does, a message that is not an object or has an unknown role is left out, and a run of tool results one of
whose call ids matches no call of the assistant message before it keeps its given order; data=chat refuses such a
conversation before it is encoded (conversations.check_conversation), so training never sees one silently changed.
Stricter than the release: a tool call whose name is not a string (the release writes str(name)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .tokenizer import K3_CONTROL_TOKENS

__all__ = ["END_OF_MSG", "OPEN", "CLOSE", "SEP", "IMAGE_PLACEHOLDER", "THINKING_EFFORTS", "Piece", "ChatTokens",
           "Reply", "render_chat", "encode_conversation", "encode_chat", "encode_prompt", "chat_images",
           "image_token_positions", "parse_reply", "decode_reply", "reply_text"]

END_OF_MSG, OPEN, CLOSE, SEP = K3_CONTROL_TOKENS
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")
IMAGE_PART_TYPES = ("image", "image_url")

# The system lines of the format, word for word as the model was trained with them.
_EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
                "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
                "Now the system is invoked with `thinking_effort={}`.")
_TOOLS_TEXT = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```"
_MORE_TOOLS_TEXT = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                    "You have access to all existing and extended tools.\nHere are the specs for the extended tools."
                    "\n\n```json\n{}\n```")


@dataclass(frozen=True)
class Piece:
    """A run of the rendered conversation tokenized on its own: a marker (`control`: special tokens allowed) or
    text (never special); `assistant`: trained on; `image`: the index of the image it stands for."""
    text: str
    control: bool = False
    assistant: bool = False
    image: int | None = None


@dataclass
class ChatTokens:
    """An encoded conversation: ids, the loss mask (1 = an assistant token), each image part's URL or path (None
    when the part names none) in order, and the [start, end) range of each image's placeholder ids in `ids`."""
    ids: list
    loss_mask: list
    images: list
    image_spans: list


class _Renderer:
    """Collects the pieces of a conversation."""

    def __init__(self):
        self.pieces, self.images, self.assistant = [], [], False

    def text(self, s) -> None:
        s = str(s)
        if s:
            self.pieces.append(Piece(s, False, self.assistant))

    def control(self, s: str) -> None:
        self.pieces.append(Piece(s, True, self.assistant))

    def open(self, tag: str, attrs=()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:
            for s in (f" {key}", '="', str(value).replace("&", "&amp;").replace('"', "&quot;"), '"'):
                self.text(s)
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.control(END_OF_MSG)

    def text_message(self, attrs, text: str) -> None:
        """A whole message of one text."""
        self.open("message", attrs)
        self.text(text)
        self.end_message()

    def image(self, source) -> None:
        self.pieces.append(Piece(IMAGE_PLACEHOLDER, True, self.assistant, image=len(self.images)))
        self.images.append(source)


def _compact_json(value, what: str) -> str:
    try:
        return json.dumps(_sorted_keys(value), ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} are not JSON: {e}") from None


def _sorted_keys(value):
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def _image_source(part: dict):
    """The URL or path of an image part: image_url (a string or {"url": ...}), image, url or path."""
    for key in ("image_url", "image", "url", "path"):
        v = part.get(key)
        if isinstance(v, dict):
            v = v.get("url") or v.get("path")
        if isinstance(v, str) and v:
            return v
    return None


def _content(r: _Renderer, where: str, content) -> None:
    """A message's content: a string, None, or a list of parts ({"type": "text", "text": ...} or an image part)."""
    if content is None:
        return
    if isinstance(content, str):
        r.text(content)
        return
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where}: content must be a string, a list of parts or null, got {type(content).__name__}")
    for n, part in enumerate(content):
        if not isinstance(part, dict) or "type" not in part:
            raise ValueError(f"{where}: content part {n} is not an object with a 'type'")
        if part["type"] in IMAGE_PART_TYPES:
            r.image(_image_source(part))
        elif "text" not in part:
            raise ValueError(f"{where}: content part {n} of type {part['type']!r} has no 'text'")
        else:
            r.text(part["text"])


def _function(where: str, n: int, call) -> dict:
    """The function of tool call n: call["function"], or the call itself in the flat form; its name a string."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ValueError(f"{where}: tool call {n} is not an object (with a 'function' object)")
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: tool call {n} has no function name")
    return fn


def _arguments(where: str, n: int, args):
    """(arguments as a dict, or the raw text when it is not JSON)."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}, None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {}, args
        if not isinstance(args, dict):
            raise ValueError(f"{where}: tool call {n}: arguments must be a JSON object, got {type(args).__name__}")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: tool call {n}: arguments must be an object or a JSON object string, got "
                         f"{type(args).__name__}")
    return args, None


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _argument(r: _Renderer, where: str, n: int, key, value) -> None:
    try:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: tool call {n}: argument {key!r} is not JSON: {e}") from None
    r.open("argument", [("key", key), ("type", _json_type(value))])
    r.text(text)
    r.close("argument")


def _tool_calls(r: _Renderer, where: str, calls) -> None:
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where}: tool_calls must be a list, got {type(calls).__name__}")
    r.open("tools")
    for n, call in enumerate(calls, 1):
        fn = _function(where, n, call)
        args, raw = _arguments(where, n, fn.get("arguments"))
        r.open("call", [("tool", fn["name"]), ("index", n)])
        if raw is not None:
            r.open("json", [("type", "object")])
            r.text(raw)
            r.close("json")
        for key, value in args.items():
            _argument(r, where, n, key, value)
        r.close("call")
    r.close("tools")


def _assistant(r: _Renderer, where: str, m: dict, thinking: bool) -> None:
    r.open("message", [("role", "assistant")] + ([("name", m["name"])] if m.get("name") else []))
    r.assistant = True
    if thinking:
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        r.open("think")
        if reasoning is not None and str(reasoning).strip():
            r.text(reasoning)
        r.close("think")
    r.open("response")
    _content(r, where, m.get("content"))
    r.close("response")
    if m.get("tool_calls"):
        _tool_calls(r, where, m["tool_calls"])
    r.end_message()
    r.assistant = False


def _call_positions(calls) -> dict:
    """{str(call id): (1-based position, function name)} of an assistant message's tool calls (first of an id)."""
    out = {}
    for n, call in enumerate(calls if isinstance(calls, (list, tuple)) else [], 1):
        if isinstance(call, dict) and call.get("id") is not None:
            fn = call.get("function")
            out.setdefault(str(call["id"]), (n, fn.get("name") if isinstance(fn, dict) else call.get("name")))
    return out


def _ordered_results(run: list, calls: dict) -> list:
    """A run of consecutive tool results [(where, message)] in the order of the calls they answer (by tool_call_id),
    each named after its call; left as it is when one has no call id."""
    keyed = []
    for offset, (where, m) in enumerate(run):
        call_id = m["tool_call_id"] if "tool_call_id" in m else m.get("id")
        # a result whose id matches no call keeps the run in its given order, as the release does (data=chat
        # refuses such a conversation before it gets here: conversations.check_conversation)
        keyed.append((None if call_id is None else calls.get(str(call_id)), offset, where, m))
    if any(k[0] is None for k in keyed):
        return run
    keyed.sort(key=lambda k: (k[0][0], k[1]))
    out = []
    for (_, name), _, where, m in keyed:
        if name is not None:
            m = {**m, "tool": name, **({"name": name} if "name" in m else {})}
        out.append((where, m))
    return out


def _checked_messages(messages) -> list:
    """[(where, message)] with each message an object with a known role; tool results in their calls' order."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list, got {type(messages).__name__}")
    items = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and "role" not in m:
            raise ValueError(f"message {i}: unknown role None (K3 has {', '.join(ROLES)})")
        if isinstance(m, dict) and m["role"] in ROLES:  # anything else the release leaves out, and so do we
            items.append((f"message {i} ({m['role']})", m))
    out, calls, k = [], {}, 0
    while k < len(items):
        if items[k][1]["role"] != "tool":
            if items[k][1]["role"] == "assistant":
                calls = _call_positions(items[k][1].get("tool_calls"))
            out.append(items[k])
            k += 1
            continue
        end = k
        while end < len(items) and items[end][1]["role"] == "tool":
            end += 1
        out += _ordered_results(items[k:end], calls)
        k = end
    return out


def _tool_result(r: _Renderer, where: str, m: dict, calls, n: int) -> None:
    """Tool result n after the last assistant message: named by 'tool' or 'name', else by the n-th call."""
    name = m["tool"] if "tool" in m else m.get("name")
    if name is None and isinstance(calls, (list, tuple)) and n <= len(calls):
        name = _function(where, n, calls[n - 1])["name"]
    if name is None:
        raise ValueError(f"{where}: a tool result needs its tool's name: a 'tool' or 'name', a tool_call_id of a "
                         f"call, or a call at its position in the assistant message before it")
    r.open("message", [("role", "tool"), ("tool", name), ("index", n)])
    _content(r, where, m.get("content"))
    r.end_message()


def _preamble(r: _Renderer, tools, thinking: bool, thinking_effort) -> None:
    """The tool declarations and the thinking-effort line."""
    if tools:
        body = _TOOLS_TEXT.format(_compact_json(tools, "tools"))
        r.text_message([("role", "system"), ("type", "tool-declare")], body)
    if thinking and thinking_effort is not None:
        if thinking_effort not in THINKING_EFFORTS:
            raise ValueError(f"unsupported thinking_effort={thinking_effort!r}: one of {', '.join(THINKING_EFFORTS)}")
        r.text_message([("role", "system"), ("type", "thinking-effort")], _EFFORT_TEXT.format(thinking_effort))


def render_chat(messages, tools=None, *, thinking: bool = True, thinking_effort: str | None = "max",
                add_generation_prompt: bool = False) -> _Renderer:
    """The conversation's pieces (`.pieces`) and its images' URLs or paths (`.images`), in order."""
    r = _Renderer()
    items = _checked_messages(messages)
    _preamble(r, tools, thinking, thinking_effort)
    calls, n = None, 0
    for where, m in items:
        role = m["role"]
        attrs = [("role", role)] + ([("name", m["name"])] if m.get("name") else [])
        if role == "assistant":
            calls, n = m.get("tool_calls"), 0
            _assistant(r, where, m, thinking)
        elif role == "tool":
            n += 1
            _tool_result(r, where, m, calls, n)
        elif role == "system" and m.get("tools"):
            r.text_message([("role", "system"), ("type", "tool-declare")],
                           _MORE_TOOLS_TEXT.format(_compact_json(m["tools"], f"{where}: tools")))
        else:
            r.open("message", attrs)
            _content(r, where, m.get("content"))
            r.end_message()
    if add_generation_prompt:
        r.open("message", [("role", "assistant")])
        r.open("think" if thinking else "response")
    return r


def _check_tokenizer(tokenizer) -> None:
    missing = [n for n in K3_CONTROL_TOKENS if n not in tokenizer.special_tokens]
    if missing:
        raise ValueError(f"the tokenizer has no special token {missing[0]}: K3 chat needs "
                         f"{', '.join(K3_CONTROL_TOKENS)} (the K3 tokenizer directory, or a tokenizer.json through "
                         f"data/tokenizer.load_tokenizer)")


def encode_conversation(tokenizer, messages, tools=None, *, thinking: bool = True,
                        thinking_effort: str | None = "max", add_generation_prompt: bool = False) -> ChatTokens:
    """The conversation's ids, loss mask, images and image placeholder spans. thinking_effort=None: no effort line."""
    _check_tokenizer(tokenizer)
    r = render_chat(messages, tools, thinking=thinking, thinking_effort=thinking_effort,
                    add_generation_prompt=add_generation_prompt)
    ids, mask, spans = [], [], []
    for p in r.pieces:
        start = len(ids)
        ids += tokenizer.encode(p.text, allow_special=p.control)
        mask += [int(p.assistant)] * (len(ids) - start)
        if p.image is not None:
            spans.append((start, len(ids)))
    return ChatTokens(ids, mask, r.images, spans)


def encode_chat(tokenizer, messages, tools=None, *, thinking: bool = True,
                thinking_effort: str | None = "max") -> tuple:
    """(ids, loss_mask) of a conversation: the release's apply_chat_template ids and assistant mask."""
    c = encode_conversation(tokenizer, messages, tools, thinking=thinking, thinking_effort=thinking_effort)
    return c.ids, c.loss_mask


def encode_prompt(tokenizer, messages, tools=None, *, thinking: bool = True,
                  thinking_effort: str | None = "max") -> list:
    """The ids of the conversation followed by the opening of an assistant reply (its think channel, or its
    response channel with thinking off): what a decoder continues."""
    return encode_conversation(tokenizer, messages, tools, thinking=thinking, thinking_effort=thinking_effort,
                               add_generation_prompt=True).ids


def chat_images(messages, tools=None) -> list:
    """The URLs or paths of a conversation's image parts, in the order of their placeholders."""
    images = render_chat(messages, tools).images
    if None in images:
        raise ValueError(f"image {images.index(None)} of the conversation names no image_url, image, url or path")
    return images


@dataclass(frozen=True)
class Reply:
    """A generated assistant message: its think and response channels' text, and whether <|end_of_msg|> came."""
    reasoning: str
    response: str
    ended: bool


def _marked_runs(tokenizer, ids) -> list:
    """ids as a list of marker names and decoded text runs, up to and with the first <|end_of_msg|>."""
    marks = {tokenizer.special_tokens[n]: n for n in K3_CONTROL_TOKENS}
    out, run = [], []
    for i in ids:
        if int(i) in marks:
            out += [tokenizer.decode(run)] if run else []
            out.append(marks[int(i)])
            run = []
            if marks[int(i)] == END_OF_MSG:
                return out
        else:
            run.append(int(i))
    return out + ([tokenizer.decode(run)] if run else [])


def parse_reply(tokenizer, ids, *, thinking: bool = True) -> Reply:
    """The reply in ids generated after encode_prompt's. They start inside the think channel (thinking) or the
    response channel; which one is read from the first channel closed, else taken from `thinking`."""
    _check_tokenizer(tokenizer)
    texts, channel, tag = {"start": [], "think": [], "response": []}, "start", None
    items = _marked_runs(tokenizer, ids)
    for item in items:
        if item in (OPEN, CLOSE):
            tag, channel = (item, [], channel), None
        elif item == SEP and tag is not None:
            name = ("".join(tag[1]).split() or [""])[0]
            if tag[0] == CLOSE and tag[2] == "start" and name in ("think", "response"):
                texts[name], texts["start"] = texts["start"] + texts[name], []
            channel, tag = (name if tag[0] == OPEN and name in ("think", "response") else None), None
        elif item == END_OF_MSG:
            break
        elif tag is not None:
            tag[1].append(item)
        elif channel is not None and item != SEP:
            texts[channel].append(item)
    texts["think" if thinking else "response"][:0] = texts["start"]
    return Reply("".join(texts["think"]), "".join(texts["response"]), END_OF_MSG in items)


def decode_reply(tokenizer, ids, *, thinking: bool = True) -> str:
    """The response text of generated ids (stopping at <|end_of_msg|>)."""
    return parse_reply(tokenizer, ids, thinking=thinking).response


reply_text = decode_reply


def image_token_positions(tokenizer, ids) -> list:
    """The positions in `ids` of the image placeholders, where the tokenizer reads <|kimi_image_placeholder|> as one
    special id (the BPEs of data/tokenizer.py: the model's placeholder id). The release's tokenizer reads it as
    ordinary text, which only encode_conversation(...).image_spans can tell from a user's typing."""
    i = tokenizer.special_tokens.get(IMAGE_PLACEHOLDER)
    if i is None:
        raise ValueError(f"the tokenizer has no special token {IMAGE_PLACEHOLDER} (it reads it as text): take the "
                         f"images' ids from encode_conversation(...).image_spans")
    return [k for k, t in enumerate(ids) if t == i]
