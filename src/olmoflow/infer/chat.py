"""``olmoflow chat DIR``: a streaming terminal chat with a release / Hugging Face directory.

The conversation is rendered with the model's own chat template
(:func:`olmoflow.tokenizer.chat.template_of`; a tokenizer without one falls back to
``plain``, with a note) and :func:`~olmoflow.tokenizer.chat.render` with
``add_generation_prompt=True``, exactly the prompt the model was fine-tuned to continue. The reply
streams token by token through :class:`~olmoflow.infer.streaming.IncrementalDecoder`, so no piece
ends inside a UTF-8 character, and stops at the template's end-of-turn token or EOS.

The model is read by :func:`olmoflow.model.load.load_model` (a release / Hugging Face directory,
a step directory, a run directory with a release, a Hub id). History is kept inside the context
window (``model.config.max_sequence_length``, or the longest training sequence length the
directory's ``config.yaml`` records, whichever is smaller:
:attr:`olmoflow.model.load.Loaded.context_length`): when the prompt
plus ``max_new_tokens`` would not fit, the oldest user/assistant turn pairs are dropped (the system
message stays), as chat front ends such as ``llama.cpp``'s ``--keep`` do; the user is told once.
A message that does not fit even alone gets a one-line notice and is not sent.

Commands at the prompt: ``/reset`` (clear the history, keep the system message), ``/system TEXT``
(set it; ``/system`` alone removes it), ``/help``, ``/exit`` (also EOF / Ctrl-D, or Ctrl-C at the
prompt). Ctrl-C during a reply stops that reply and keeps what was said.

Python API: :class:`ChatSession` (``reply(text)`` yields the pieces) and :func:`chat_main`
(the command, with ``input_fn`` / ``output`` for scripted use); :func:`add_chat_parser` adds the
verb to an ``argparse`` sub-parser set.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TextIO

import torch

from olmoflow.errors import OlmoflowError, closest
from olmoflow.infer.generate import iter_tokens
from olmoflow.infer.sampling import SamplingParams
from olmoflow.infer.streaming import IncrementalDecoder
from olmoflow.tokenizer.chat import (
    ChatTemplate,
    add_chat_template,
    end_of_turn_ids,
    get_template,
    render,
    template_of,
)

EXIT_OK, EXIT_USAGE = 0, 2
COMMANDS = ("/reset", "/system", "/help", "/exit", "/quit")
HELP = ("commands: /reset (clear the history, keep the system message), /system TEXT (set the "
        "system message; /system alone removes it), /help, /exit (or Ctrl-D)")
# The chat's default sampling: a little randomness keeps small models out of loops.
DEFAULT_SAMPLING = SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.9)


def resolve_template(tokenizer: Any, model: Any = None,
                     template: str | ChatTemplate | None = None) -> tuple[ChatTemplate, str | None]:
    """The chat template to talk with, and a note for the user (None when there is nothing to
    say).

    ``template`` names one explicitly; else the tokenizer's own (:func:`template_of`: a named
    template, or any other Jinja template, rendered as ``transformers`` does). A tokenizer
    without a template falls back to ``plain``: its ``<|sep|>`` token is added to ``tokenizer``
    (and to ``model``'s embedding, as the mean of the trained rows) in place, an untrained token,
    so a model that never saw the format answers poorly; the note says so.

    Raises:
        OlmoflowError: an unknown template name, or a tokenizer template that does not compile.
    """
    if template is not None:
        t = get_template(template)
    elif tokenizer.chat_template is None:
        t = get_template("plain")
    else:
        t = template_of(tokenizer)
    missing = [s for s in t.special_tokens if tokenizer.token_to_id(s) is None]
    if missing or (t.bos_is_eos and tokenizer.bos_token is None):
        add_chat_template(tokenizer, t, model=model)
        return t, (f"the tokenizer has no chat template tokens ({', '.join(missing) or 'BOS'}); "
                   f"using the '{t.name}' template with them added untrained: replies of a model "
                   "never fine-tuned on it will be poor")
    if template is None and tokenizer.chat_template is None:
        return t, f"the tokenizer has no chat template; using '{t.name}'"
    return t, None


class ChatSession:
    """One conversation with a model: the system message, the history, and the sampling.

    Args:
        model: an :class:`~olmoflow.model.olmo.Olmo` (anything :func:`iter_tokens` decodes).
        tokenizer: its tokenizer (a :class:`~olmoflow.tokenizer.base.BaseTokenizer`).
        system: the system message (None: none; ``olmo3`` then renders its default one).
        sampling: how to sample each reply (default :data:`DEFAULT_SAMPLING`: 256 new tokens,
            temperature 0.7, top-p 0.9). With a ``seed``, reply number ``k`` of the session
            (counted from 0, across ``reset``) uses ``seed + k``: a scripted session replays
            exactly, and two replies to the same text still differ.
        template: a template name or :class:`ChatTemplate` (default: the tokenizer's; see
            :func:`resolve_template`, which may add tokens to ``tokenizer`` and ``model``).
        max_context: the context window in tokens (default ``model.config.max_sequence_length``);
            the prompt plus ``sampling.max_new_tokens`` is kept within it.
        on_notice: called with each one-line notice (template fallback, history trimmed, message
            too long); every notice is also appended to :attr:`notices`.

    Attributes:
        history: the user/assistant turns, ``[{"role", "content"}, ...]``, oldest first.
        last_prompt_ids: the ids of the last prompt sent to the model.

    Raises:
        OlmoflowError: ``max_new_tokens`` leaves no room for a prompt in ``max_context``, or a
            template error of :func:`resolve_template`.
    """

    def __init__(self, model: Any, tokenizer: Any, *, system: str | None = None,
                 sampling: SamplingParams | None = None,
                 template: str | ChatTemplate | None = None, max_context: int | None = None,
                 on_notice: Callable[[str], None] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.sampling = sampling if sampling is not None else DEFAULT_SAMPLING
        self.notices: list[str] = []
        self.on_notice = on_notice
        self.template, note = resolve_template(tokenizer, model, template)
        if note:
            self._notice(note)
        self.max_context = int(max_context or model.config.max_sequence_length)
        if self.sampling.max_new_tokens >= self.max_context:
            raise OlmoflowError(
                f"max_new_tokens={self.sampling.max_new_tokens} leaves no room for a prompt in "
                f"the {self.max_context}-token context window; lower --max-new-tokens")
        self.system = system
        self.history: list[dict[str, str]] = []
        self.last_prompt_ids: list[int] = []
        self.replies = 0
        self._told_trimmed = False
        # The template's end-of-turn token and the tokenizer's EOS both end a reply (an OLMo 3
        # tokenizer whose EOS was left at <|endoftext|> still ends turns with <|im_end|>).
        self.stop_ids = set(end_of_turn_ids(self.template, tokenizer))

    def _notice(self, text: str) -> None:
        self.notices.append(text)
        if self.on_notice is not None:
            self.on_notice(text)

    def reset(self) -> None:
        """Forget the history; the system message and the sampling stay."""
        self.history.clear()
        self._told_trimmed = False

    def set_system(self, text: str | None) -> None:
        """Set the system message (None or ``""``: none); the history stays."""
        self.system = text or None

    def messages(self) -> list[dict[str, str]]:
        """The conversation as rendered: the system message (if any), then the history."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.history

    def _fit(self) -> list[int] | None:
        """The prompt ids of the conversation, dropping the oldest turn pairs until it fits in
        ``max_context - max_new_tokens``; None (the new message removed, the history kept) when
        the new message does not fit even alone."""
        budget = self.max_context - self.sampling.max_new_tokens

        def prompt(history: list[dict[str, str]]) -> list[int]:
            head = [{"role": "system", "content": self.system}] if self.system else []
            return render(head + history, self.template, self.tokenizer,
                          add_generation_prompt=True)[0]

        alone = prompt(self.history[-1:])
        if len(alone) > budget:
            self.history.pop()
            self._notice(f"message not sent: its prompt is {len(alone)} tokens, and with "
                         f"{self.sampling.max_new_tokens} new tokens that exceeds the "
                         f"{self.max_context}-token context window; shorten it")
            return None
        dropped = 0
        ids = prompt(self.history)
        while len(ids) > budget:  # the new message alone fits, so this ends
            del self.history[:2]  # the oldest user turn and the reply to it
            dropped += 1
            ids = prompt(self.history)
        if dropped and not self._told_trimmed:
            self._told_trimmed = True
            self._notice(f"dropped the oldest {dropped} exchange(s) to keep the conversation "
                         f"within the {self.max_context}-token context window (older ones go "
                         "the same way from now on)")
        return ids

    def reply(self, text: str) -> Iterator[str]:
        """Send the user message ``text`` and stream the reply.

        The prompt is built (and the history trimmed) by this call, before the first piece, so
        notices come first; the reply joins the history as it streams (a reply stopped early,
        by closing the iterator, keeps what was said).

        Yields:
            Non-empty text pieces whose concatenation is the decoded reply (special tokens
            dropped); none ends inside a multi-byte character. Nothing when the message did not
            fit (see :attr:`notices`).
        """
        self.history.append({"role": "user", "content": text})
        ids = self._fit()
        if ids is None:
            return _nothing()
        self.last_prompt_ids = ids
        sp = self.sampling
        if sp.seed is not None:
            sp = replace(sp, seed=sp.seed + self.replies)
        self.replies += 1
        device = getattr(self.model, "device", None)
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        steps = iter_tokens(self.model, prompt, sampling=sp,
                            eos_token_id=self.tokenizer.eos_token_id, tokenizer=self.tokenizer)
        turn = {"role": "assistant", "content": ""}
        self.history.append(turn)
        return self._stream(steps, IncrementalDecoder(self.tokenizer, ids), turn)

    def _stream(self, steps: Iterator[torch.Tensor], decoder: IncrementalDecoder,
                turn: dict[str, str]) -> Iterator[str]:
        said: list[str] = []
        try:
            for nxt in steps:
                tok = int(nxt.reshape(-1)[0])
                if tok in self.stop_ids:
                    break
                piece = decoder.push(tok)
                if piece:
                    said.append(piece)
                    turn["content"] = "".join(said)
                    yield piece
            rest = decoder.flush()
            if rest:
                said.append(rest)
                turn["content"] = "".join(said)
                yield rest
        finally:
            steps.close()  # puts the model back in its training mode


def _nothing() -> Iterator[str]:
    """An empty reply that, like a real one, can be closed."""
    yield from ()


# ---- the command ---------------------------------------------------------------------------


def add_chat_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of ``olmoflow chat`` on parser ``p``; returns ``p``."""
    d = DEFAULT_SAMPLING
    p.add_argument("model", metavar="DIR",
                   help="a release or Hugging Face directory (also a step directory, or a run "
                   "directory with a release)")
    p.add_argument("--system", help="the system message")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens per reply at most (default {d.max_new_tokens}, at most half the "
                   "context window)")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help=f"sampling temperature; 0 is greedy (default {d.temperature})")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help=f"nucleus sampling mass (default {d.top_p})")
    p.add_argument("--top-k", type=int, default=d.top_k,
                   help="sample among the k most likely tokens (default: all)")
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty,
                   help="CTRL repetition penalty, 1.0 is off (default 1.0)")
    p.add_argument("--seed", type=int,
                   help="seed of the first reply (reply k uses seed + k; default: random)")
    p.add_argument("--template", help="chat template to use instead of the tokenizer's: "
                   "olmo3, tulu or plain")
    p.add_argument("--tokenizer", help="directory with tokenizer.json (default: beside the model)")
    p.add_argument("--max-context", type=int,
                   help="context window in tokens (default: the trained sequence length, else "
                   "the model's maximum)")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    return p


def add_chat_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``chat`` verb to ``subparsers`` (an ``add_subparsers()`` result); the parsed
    namespace carries ``tool=run_chat`` (it raises OlmoflowError for the CLI to print)."""
    p = subparsers.add_parser("chat", help="talk with a model in the terminal (streaming)")
    add_chat_arguments(p)
    p.set_defaults(tool=run_chat)
    return p


def _command(line: str) -> tuple[str, str] | None:
    """``(command, argument)`` when ``line`` is a command: a first word of ``/`` and a name
    (``/etc/hosts?`` is a message, not a command)."""
    word, _, rest = line.strip().partition(" ")
    if word.startswith("/") and len(word) > 1 and "/" not in word[1:]:
        return word, rest.strip()
    return None


def run_chat(args: argparse.Namespace, *, input_fn: Callable[[str], str] = input,
             output: TextIO | None = None) -> int:
    """Run the chat loop for parsed ``args`` (see :func:`add_chat_arguments`); returns
    :data:`EXIT_OK` when the user leaves.

    Raises:
        OlmoflowError: the model does not load, or the sampling settings are out of range.
    """
    out = output if output is not None else sys.stdout

    def say(text: str = "", end: str = "\n") -> None:
        out.write(text + end)
        out.flush()

    # Checked before the (slow) model load; max_new_tokens is set once the window is known.
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 1:  # 0 would answer every message with nothing
            raise OlmoflowError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        sampling = replace(sampling, max_new_tokens=args.max_new_tokens)
    from olmoflow.model.load import load_model

    loaded = load_model(args.model, tokenizer=args.tokenizer, device=args.device or "auto")
    model, tok, src = loaded.model, loaded.tokenizer, loaded.path
    window = args.max_context or loaded.context_length
    if args.max_new_tokens is None:  # a small demo model's window still leaves room to talk
        sampling = replace(sampling, max_new_tokens=min(DEFAULT_SAMPLING.max_new_tokens,
                                                        window // 2))
    session = ChatSession(model, tok, system=args.system, sampling=sampling,
                          template=args.template, max_context=window,
                          on_notice=lambda n: say(f"[note] {n}"))
    say(f"chatting with {src} (template {session.template.name}, context "
        f"{session.max_context} tokens); /help for commands, /exit or Ctrl-D to leave")
    while True:
        try:
            line = input_fn(">>> ")
        except (EOFError, KeyboardInterrupt):
            say()
            return EXIT_OK
        cmd = _command(line)
        if cmd is not None:
            name, arg = cmd
            if name in ("/exit", "/quit"):
                return EXIT_OK
            if name == "/reset":
                forgotten = sum(m["role"] == "user" for m in session.history)
                session.reset()
                say(f"[history cleared: {forgotten} exchange(s) forgotten]")
            elif name == "/system":
                session.set_system(arg)
                say(f"[system message set: {arg}]" if arg else "[system message removed]")
            elif name == "/help":
                say(HELP)
            else:
                hint = closest(name, COMMANDS)
                say(f"[unknown command {name}" + (f"; did you mean {hint}?]" if hint
                                                    else f"; {HELP}]"))
            continue
        if not line.strip():
            continue
        turns = len(session.history)
        pieces = session.reply(line)
        wrote = False
        try:
            for piece in pieces:
                out.write(piece)
                out.flush()
                wrote = True
        except KeyboardInterrupt:  # stop this reply, keep the conversation
            pieces.close()
            say(" [stopped]", end="")
            wrote = True
        if wrote:
            say()
        elif len(session.history) > turns:  # sent (a message that did not fit is not kept)
            say("[no reply: the model ended its turn at once]")


def chat_main(argv: Sequence[str] | argparse.Namespace | None = None, *,
              input_fn: Callable[[str], str] = input, output: TextIO | None = None,
              errors: TextIO | None = None) -> int:
    """``olmoflow chat`` as a function: parse ``argv`` (or take a parsed namespace), chat, and
    return the exit status: 0 when the user leaves, 2 after a one-line error on ``errors``
    (default stderr) for a model that does not load or a bad setting.

    ``input_fn`` reads a line (``EOFError`` ends the chat); the transcript goes to ``output``.
    """
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = add_chat_arguments(argparse.ArgumentParser(prog="olmoflow chat"))
        args = parser.parse_args(None if argv is None else list(argv))
    try:
        return run_chat(args, input_fn=input_fn, output=output)
    except OlmoflowError as e:
        print(f"olmoflow chat: error: {e}", file=errors if errors is not None else sys.stderr)
        return EXIT_USAGE
