"""A checkpoint's chat template (jinja2, as Hugging Face tokenizers ship it), kept token-in-token-out.

The template is rendered for text only twice per job and once per episode:

* the **opening** of every episode -- the system prompt and the first observation as the
  template lays them out, up to its generation prompt -- rendered and tokenised per episode;
* the **turn wrapper** -- what the template puts between a model turn and the next observation
  (``close``) and after an observation up to the next generation prompt (``generation``) --
  rendered once, with sentinel contents, and tokenised once into fixed ids.

After the opening, a conversation only ever grows by ids: the model's sampled ids exactly as
sampled, then ``close + encode(observation) + generation``. Nothing already in it is decoded and
encoded again, so the ids trained on are the ids sampled, whatever the tokenizer would make of
their text. A turn that ended on its end-of-turn token already holds it, so ``close`` then starts
after that token; a turn cut off by the token limit gets the whole closing text, end-of-turn
token included, as the template would have rendered it.

Later observations are rendered as the template renders message contents -- verbatim, trimmed
(Llama 3's and Gemma's ``| trim``) or JSON-quoted (Llama 3.1's ipython turns) -- which two probe
contents find out, and in ``spec.environment.observationRole`` (tool, ipython) where the template
has that role; a template without it (Gemma) gets them as user turns, and the actor says so.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NoReturn

from tokenizers import Tokenizer

# Contents with no whitespace or markup, so no template trims or escapes them.
_SENTINELS = ("STOKERFIRSTUSERSENTINEL", "STOKERMODELTURNSENTINEL", "STOKERNEXTUSERSENTINEL")


class ChatTemplateError(ValueError):
    """A chat template that does not render, or cannot be kept as appended ids."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"the chat template raised: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """A jinja2 template in the environment Hugging Face renders chat templates in: sandboxed,
    ``trim_blocks``/``lstrip_blocks``, loop controls, and the globals templates use
    (``raise_exception``, ``strftime_now``) and the ``tojson`` filter."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as err:
        raise ChatTemplateError(f"the chat template does not parse: {err}") from err


def render(
    template: Any, messages: list[dict[str, str]], *, bos_token: str | None, eos_token: str | None,
    add_generation_prompt: bool = True,
) -> str:
    from jinja2 import TemplateError

    try:
        return str(
            template.render(
                messages=messages, bos_token=bos_token or "", eos_token=eos_token or "",
                add_generation_prompt=add_generation_prompt, tools=None,
            )
        )
    except TemplateError as err:
        raise ChatTemplateError(f"the chat template does not render: {err}") from err


# Observation contents that tell apart what templates do to a message's content: kept verbatim,
# ``| trim``-med (Llama 3, Gemma 3) or ``| tojson``-ed (Llama 3.1's ipython turns).
_PROBES = ('  STOKERPROBE "one"\n é  ', "\nSTOKERPROBE\ttwo \\ ")
_CONTENT_FORMS: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("verbatim", lambda text: text),
    ("trim", str.strip),
    ("json", lambda text: _tojson(text)),
    ("trimmed json", lambda text: _tojson(text.strip())),
)
OBSERVATION_ROLES = ("user", "tool", "ipython")


@dataclass(frozen=True)
class ChatTurns:
    """The rendered pieces of one chat template for one tokenizer (see the module docstring)."""

    template: Any
    bos_token: str | None
    eos_token: str | None
    system_prompt: str | None
    close_ids: tuple[int, ...]  # after a model turn that ended on its end-of-turn token
    unterminated_close_ids: tuple[int, ...]  # after a model turn cut off by the token limit
    generation_ids: tuple[int, ...]  # after every later observation: the generation prompt
    turn_end_id: int | None  # the template's end-of-turn token (a stop token), when it is one token
    observation_role: str = "user"  # the role later observations are rendered in
    content_form: str = "verbatim"  # what the template does to an observation's text (_CONTENT_FORMS)
    role_fallback: str | None = None  # why the asked-for observation role was not used

    def messages(self, first_observation: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": first_observation}]

    def opening_text(self, first_observation: str) -> str:
        return render(
            self.template, self.messages(first_observation), bos_token=self.bos_token, eos_token=self.eos_token
        )

    def observation_text(self, observation: str) -> str:
        """A later observation as the template renders its content (trimmed, JSON-quoted...)."""
        return dict(_CONTENT_FORMS)[self.content_form](observation)


def _split_later_turn(
    template: Any, head: list[dict[str, str]], role: str, *, bos_token: str | None, eos_token: str | None
) -> tuple[str, str, str]:
    """(close, generation, content form): the text the template puts around a later observation
    in ``role``, and what it does to the observation's content, found with two probe contents."""
    found: dict[str, set[tuple[str, str]]] = {name: set() for name, _ in _CONTENT_FORMS}
    for probe in _PROBES:
        full = render(template, [*head, {"role": role, "content": probe}], bos_token=bos_token, eos_token=eos_token)
        model_end = full.index(_SENTINELS[1]) + len(_SENTINELS[1])
        for name, form in _CONTENT_FORMS:
            shown = form(probe)
            at = full.find(shown, model_end)
            if at >= 0 and full.count(shown, model_end) == 1:
                found[name].add((full[model_end:at], full[at + len(shown) :]))
    for name, _ in _CONTENT_FORMS:
        if len(found[name]) == 1:  # the same close and generation around both probes
            close, generation = found[name].pop()
            return close, generation, name
    raise ChatTemplateError(
        f"the chat template renders a {role} message's content in a way other than verbatim, trimmed or "
        "JSON-quoted, so later observations cannot be appended as ids; set model.chatTemplate to one that does"
    )


def _role_fallback(
    template: Any, source: str, head: list[dict[str, str]], role: str, *, bos_token: str | None, eos_token: str | None
) -> str | None:
    """Why ``role`` cannot carry observations in this template (None when it can)."""
    if role == "user":
        return None
    if not re.search(rf"""['"]{role}['"]""", source):
        return f"the chat template has no {role!r} role"
    try:
        render(template, [*head, {"role": role, "content": _SENTINELS[2]}], bos_token=bos_token, eos_token=eos_token)
    except ChatTemplateError as err:
        return f"the chat template refuses a {role!r} turn after the model's ({err})"
    return None


def build_chat_turns(
    tokenizer: Tokenizer, source: str, *, bos_token: str | None, eos_token: str | None, system_prompt: str | None = None,
    observation_role: str = "user",
) -> ChatTurns:
    """Render ``source`` with sentinel turns and cut the fixed wrapper ids out of it. Later
    observations go in ``observation_role`` (tool, ipython) where the template has that role, else
    in the user role (``ChatTurns.role_fallback`` says why)."""
    template = compile_template(source)
    first, model, nxt = _SENTINELS
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    head = [*system, {"role": "user", "content": first}, {"role": "assistant", "content": model}]
    opening = render(template, [*system, {"role": "user", "content": first}], bos_token=bos_token, eos_token=eos_token)
    full = render(template, [*head, {"role": "user", "content": nxt}], bos_token=bos_token, eos_token=eos_token)
    if not full.startswith(opening) or any(full.count(s) != 1 for s in _SENTINELS):
        raise ChatTemplateError(
            "the chat template renders the first turn differently once later turns follow it, so the "
            "conversation cannot grow by appended ids; set model.chatTemplate to one that does not"
        )
    model_at = full.index(model)
    if not opening.endswith(full[full.index(first) + len(first) : model_at]) or model_at < len(opening):
        raise ChatTemplateError("the chat template's generation prompt does not precede the model's turn")
    fallback = _role_fallback(template, source, head, observation_role, bos_token=bos_token, eos_token=eos_token)
    role = "user" if fallback else observation_role
    close, generation, content_form = _split_later_turn(template, head, role, bos_token=bos_token, eos_token=eos_token)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False).ids)

    close_ids = encode(close)
    special = {int(i) for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    turn_end = close_ids[0] if close_ids and close_ids[0] in special else None
    content = tokenizer.id_to_token(turn_end) if turn_end is not None else None
    if turn_end is not None and content is not None and close.startswith(content):
        terminated = encode(close[len(content) :])
    else:
        turn_end, terminated = None, close_ids
    if not encode(generation):
        raise ChatTemplateError("the chat template renders no generation prompt (add_generation_prompt)")
    return ChatTurns(
        template=template, bos_token=bos_token, eos_token=eos_token, system_prompt=system_prompt,
        close_ids=terminated, unterminated_close_ids=close_ids, generation_ids=encode(generation),
        turn_end_id=turn_end, observation_role=role, content_form=content_form, role_fallback=fallback,
    )
