"""Untrusted text in judge prompts and judge outputs: normalise, defang, recognise echoes.

    shown = neutralise(agent_text)        # what a judge prompt carries instead of the agent's text
    skel = fold(text)                     # matching skeleton: decoded, NFKD, marks/invisibles dropped, lower case
    out = blank_echoed_verdicts(judge_output, [shown, ...])   # the parsers' view of a judge's output

Threat: a trajectory (or a retrieved document) writes verdict markup of some judge (``<score>``,
``<rating>``, ``<critique>``, ``<labels>``, the CW-GRPO keys ``thinking_reward`` / ``retrieval_reward``) in any
encoding a judge or ``json.loads`` could turn back into markup when it quotes the text after its
own verdict: ``\\u``/``\\U``/``\\x``/``\\N{}``/octal/markdown escapes, HTML entities, URL ``%XX``,
full-width or look-alike brackets, zero-width and other invisible characters, any case, and
any of these nested (double encoding).

:func:`neutralise` decodes and normalises the text to a fixed point (NFKC, escapes, look-alike
brackets to ``<``/``>``, format characters removed) and then defangs every verdict token found
in the text's :func:`fold` (tags become ``[score]``, keys ``thinking-reward``), and chat-template
tokens (``<|im_end|>`` → ``[|im_end|]``), which a judge's tokenizer would read as the end of its
prompt's turn (the rollout decodes actions with their special tokens). Invariant
(tested): ``fold(neutralise(x))`` holds no verdict token, so neither does any NFKC-normalised,
escape-decoded, bracket-normalised, lower-cased or invisible-stripped copy of it.

:func:`blank_echoed_verdicts` is the parsers' second line: a verdict token the judge wrote
inside a copy of the quoted text (compared after :func:`fold` on both sides) does not count.
Given the quoted texts as the prompt showed them (neutralised), it never blanks a verdict the
judge wrote itself: those texts hold no verdict token even after folding. The raw agent text would
not do: a trajectory could write the judge's likely verdict itself and so turn the judge's real
verdict into a failure (with ``critic.on_failure=outcome`` a failed critic labels every search
turn with the outcome).
"""
from __future__ import annotations

import bisect
import html
import re
import unicodedata
from typing import Optional, Sequence

_ROUNDS = 16  # decoding rounds before a text counts as hostile (each round undoes one level of encoding)

# Characters that read as "<", ">" or "_" to a person or a normalising judge: Unicode's confusables for
# < and >, angle brackets and quotation marks, relations drawn as angles, C1 codes that cp1252 shows as ‹ ›.
_LT = "\u02c2\u02f1\u1438\u16b2\u2039\u2329\u27e8\u3008\u300a\u276e\u276c\u2770\u29fc\ufe3f\ufe3d\u27ea\u2991" \
      "\u2993\u227a\u22d6\u226a\u22d8\u226e\u2a79\u2a7b\u25c1\u25c3\u25c5\u22b2\u00ab\u008b\ufe64\uff1c\U0001d236"
_GT = "\u02c3\u02f2\u1433\U00016f3f\u203a\u232a\u27e9\u3009\u300b\u276f\u276d\u2771\u29fd\ufe40\ufe3e\u27eb\u2992" \
      "\u2994\u227b\u22d7\u226b\u22d9\u226f\u2a7a\u2a7c\u25b7\u25b9\u25bb\u22b3\u00bb\u009b\ufe65\uff1e\U0001d237"
_US = "\u2017\u07fa\u02cd\u0332\u0333\ufe33\ufe34\ufe4d\ufe4e\ufe4f\uff3f"
LOOKALIKE = {**dict.fromkeys(_LT, "<"), **dict.fromkeys(_GT, ">"), **dict.fromkeys(_US, "_")}
# Invisible but not category Cf: combining grapheme joiner, variation selectors, Hangul fillers, Khmer vowels.
_INVISIBLE = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u3164\uffa0"
                       + "".join(map(chr, range(0xFE00, 0xFE10))) + "".join(map(chr, range(0xE0100, 0xE01F0))))

_ESC = re.compile(  # either case of u / U / x / N: a judge may change case before decoding
    r"\\+[uU](?P<hi>[dD][89abAB][0-9a-fA-F]{2})\\+[uU](?P<lo>[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|\\+[uUxX]\{(?P<brace>[0-9a-fA-F]{1,6})\}"
    r"|\\+[uU](?P<u8>[0-9a-fA-F]{8})|\\+[uU](?P<u4>[0-9a-fA-F]{4})|%[uU](?P<pu>[0-9a-fA-F]{4})"
    r"|(?P<xbytes>\\+[xX][0-9a-fA-F]{2}(?:\\+[xX][89abAB][0-9a-fA-F]){0,3})"
    r"|(?P<pbytes>%[0-9a-fA-F]{2}(?:%[89abAB][0-9a-fA-F]){0,3})"
    r"|\\+[nN]\{(?P<name>[A-Za-z0-9 \-]{1,88})\}|\\+(?P<oct>[0-3][0-7]{2})|\\+(?P<punct>[!-/:-@\[-`{-~])"
    r"|(?P<html>&(?:#[0-9]+;?|#[xX][0-9a-fA-F]+;?|[A-Za-z][A-Za-z0-9]{0,31};?))")  # names: no escape inside
_ESCAPE_START = re.compile(r"[\\%&]")

# Verdict tokens in a fold: each side of a tag, and the CW-GRPO keys (the character to defang, what it becomes).
_SK_OPEN = re.compile(r"<\s*/?\s*(?:score|rating|critique|labels)")
_SK_CLOSE = re.compile(r"(?:score|rating|critique|labels)\s*/?\s*>")
_SK_KEY = re.compile(r"(?:thinking|retrieval)_reward")
_SK_SPECIAL = re.compile(r"<\||\|>")  # chat-template tokens (<|im_end|>): a tokenizer would end the judge's turn
# Verdict tokens as the parsers accept them: literal ASCII, in a judge's output.
LITERAL_TOKEN = re.compile(r"</?(?:score|rating|critique|labels)>|[\"'](?:thinking|retrieval)_reward[\"']",
                           re.IGNORECASE | re.ASCII)


def _code_point(v: int) -> Optional[str]:
    return chr(v) if v <= 0x10FFFF and not 0xD800 <= v < 0xE000 else None


def _bytes_char(hexes: list) -> tuple[str, int]:
    """The first character of a byte run (UTF-8, else cp1252 / Latin-1) and how many bytes it used."""
    b = bytes(int(h, 16) for h in hexes)
    if b[0] < 0x80:
        return chr(b[0]), 1
    n = 2 if 0xC0 <= b[0] < 0xE0 else 3 if 0xE0 <= b[0] < 0xF0 else 4 if 0xF0 <= b[0] < 0xF8 else 0
    if n and len(b) >= n:
        try:
            return b[:n].decode("utf-8"), n
        except UnicodeDecodeError:
            pass
    return b[:1].decode("cp1252", errors="ignore") or chr(b[0]), 1


def _unescape(m: re.Match) -> str:
    """One escape sequence decoded; text it cannot decode stays as it is."""
    src, g = m.group(), m.lastgroup
    try:
        if g == "lo":
            c = _code_point(0x10000 + ((int(m["hi"], 16) - 0xD800) << 10) + int(m["lo"], 16) - 0xDC00)
        elif g in ("brace", "u4", "pu"):
            c = _code_point(int(m[g], 16))
        elif g == "u8":  # not a code point: read as \\u with four digits and text after it
            c = _code_point(int(m[g], 16))
            if c is None:
                c = _code_point(int(m[g][:4], 16))
                return src if c is None else c + m[g][4:]
        elif g in ("xbytes", "pbytes"):
            parts = re.findall(r"(\\+[xX]|%)([0-9a-fA-F]{2})", src)
            c, n = _bytes_char([h for _, h in parts])
            return c + "".join(p + h for p, h in parts[n:])
        elif g == "name":
            c = unicodedata.lookup(m[g])
        elif g == "oct":
            c = chr(int(m[g], 8))
        elif g == "punct":
            c = m[g]
        else:  # an entity in the wrong case (&lT;) is read as a judge that lower-cases it would
            out, low = html.unescape(src), html.unescape(src.lower())
            return low if out == src and low != src.lower() else out
    except (KeyError, ValueError):
        return src
    return src if c is None else c


def _decode(text: str, spans: Optional[tuple[list, list]] = None):
    """One round of escape decoding: ``(text, spans)``; ``spans`` (start and end in the original text of each
    character) are carried along when given."""
    if spans is None:
        return _ESC.sub(_unescape, text), None
    st, en = spans
    out, ost, oen, last = [], [], [], 0
    for m in _ESC.finditer(text):
        rep = _unescape(m)
        a, b = m.span()
        if rep == m.group():
            continue
        k = 0  # an unconsumed tail of the match (HTML's entity prefixes, a byte run's later bytes) keeps its spans
        while k < min(len(rep), b - a - 1) and rep[-1 - k] == text[b - 1 - k]:
            k += 1
        out += [text[last:a], rep]
        ost += st[last:a] + [st[a]] * (len(rep) - k) + st[b - k:b]
        oen += en[last:a] + [en[b - k - 1]] * (len(rep) - k) + en[b - k:b]
        last = b
    out.append(text[last:])
    return "".join(out), (ost + st[last:], oen + en[last:])


class _CharMap(dict):
    """A ``str.translate`` table filled on first use."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __missing__(self, code: int) -> str:
        self[code] = v = self.fn(chr(code))
        return v


def _invisible(c: str) -> bool:
    return c in _INVISIBLE or unicodedata.category(c) == "Cf"


def _display_char(c: str) -> str:
    return "" if _invisible(c) else LOOKALIKE.get(c, c)


def _skeleton_char(c: str) -> str:
    if c in LOOKALIKE:
        return LOOKALIKE[c]
    out = []
    for ch in unicodedata.normalize("NFKD", c):
        ch = LOOKALIKE.get(ch, ch)
        if not _invisible(ch) and unicodedata.category(ch)[0] != "M":
            out.append(ch)
    return "".join(out)


_DISPLAY, _SKELETON = _CharMap(_display_char), _CharMap(_skeleton_char)


def canonical(text: str) -> str:
    """``text`` decoded and normalised to a fixed point: NFKC, invisible characters removed, escape sequences
    and entities decoded, look-alike brackets as ``<`` / ``>``. Still decoding after 16 rounds: hostile, its
    escape characters become U+FFFD."""
    for _ in range(_ROUNDS):
        new = _decode(unicodedata.normalize("NFKC", text).translate(_DISPLAY))[0]
        if new == text:
            return text
        text = new
    return unicodedata.normalize("NFKC", _ESCAPE_START.sub("\ufffd", text)).translate(_DISPLAY)


def fold(text: str) -> str:
    """The matching skeleton of ``text``: per character NFKD with marks and invisible characters dropped and
    look-alikes mapped, escapes decoded, to a fixed point; lower case."""
    return _fold(text, False)[0]


def fold_spans(text: str) -> tuple[str, list, list]:
    """``(fold(text), start, end)``: character ``i`` of the fold comes from ``text[start[i]:end[i]]``."""
    return _fold(text, True)


def _fold(text: str, with_spans: bool):
    spans = (list(range(len(text))), list(range(1, len(text) + 1))) if with_spans else None
    for _ in range(_ROUNDS):
        mapped, spans = _map_chars(text, spans, None)
        new, spans = _decode(mapped, spans)
        if new == text:
            break
        text = new
    else:  # still decoding: hostile; its escape characters stop counting
        text, spans = _map_chars(text, spans, lambda c: "\ufffd" if c in "\\%&" else c)
        text, spans = _map_chars(text, spans, None)
    if spans is None:
        return (text.lower(),)
    text, spans = _map_chars(text, spans, str.lower)
    return (text, *spans)


def _map_chars(text: str, spans, fn):
    """Each character replaced by ``fn(c)`` (None: its skeleton), carrying the spans."""
    if spans is None:
        return (text.translate(_SKELETON) if fn is None else "".join(map(fn, text))), None
    out, st, en = [], [], []
    for c, s, e in zip(text, *spans):
        r = _SKELETON[ord(c)] if fn is None else fn(c)
        out.append(r)
        st += [s] * len(r)
        en += [e] * len(r)
    return "".join(out), (st, en)


def _verdict_chars(skel: str) -> dict:
    """Fold index → replacement for each character that makes a verdict token."""
    hits = {m.start(): "[" for m in _SK_OPEN.finditer(skel)}
    hits.update({m.end() - 1: "]" for m in _SK_CLOSE.finditer(skel)})
    hits.update({m.start() + skel[m.start():m.end()].index("_"): "-" for m in _SK_KEY.finditer(skel)})
    hits.update({m.start() + (m.group() == "|>"): "]" if m.group() == "|>" else "["
                 for m in _SK_SPECIAL.finditer(skel)})
    return hits


def neutralise(text: str) -> str:
    """Trajectory text as a judge prompt shows it: :func:`canonical`, then every verdict token of every judge
    defanged (``<score>`` → ``[score]``, ``thinking_reward`` → ``thinking-reward``, ``<|im_end|>`` →
    ``[|im_end|]``); still readable."""
    text = canonical(str(text))
    for _ in range(_ROUNDS):
        if not _verdict_chars(fold(text)):
            return text
        skel, st, en = fold_spans(text)
        edits = sorted({(st[i], en[i]): r for i, r in _verdict_chars(skel).items()}.items(), reverse=True)
        end = len(text) + 1
        for (s, e), r in edits:  # right to left; a span inside one already replaced is skipped
            if e <= end:
                text, end = text[:s] + r + text[e:], s
    # Not settled (adversarial nesting): every bracket and underscore goes.
    return text.translate(str.maketrans({"<": "[", ">": "]", "_": "-", "\\": "\ufffd", "%": "\ufffd", "&": "\ufffd"}))


def blank_echoed_verdicts(text: str, quoted: Sequence[str], window: int = 32) -> str:
    """``text`` with every literal verdict token that lies in a copy of one of ``quoted`` blanked (U+FFFD).

    A copy is a stretch of ``window`` characters (the whole quoted text when shorter) around the token whose
    :func:`fold` occurs in the quoted text's fold: a judge that copies the text raw, NFKC-normalised, escape-decoded
    or bracket-normalised is recognised.
    """
    tokens = list(LITERAL_TOKEN.finditer(text)) if quoted else []
    folds = [f for f in (fold(q) for q in quoted if q) if f] if tokens else []
    tokens = [m for m in tokens if any(fold(m.group()) in f for f in folds)]
    if not tokens:
        return text
    skel, st, en = fold_spans(text)
    out, grams = list(text), {}
    for m in tokens:
        s, e = m.span()
        fs, fe = bisect.bisect_right(en, s), bisect.bisect_left(st, e)
        for j, f in enumerate(folds):
            w = min(window, len(f))
            if fe - fs > w or skel[fs:fe] not in f:
                continue
            if j not in grams:  # every stretch of w characters of the quoted text, built once
                grams[j] = {f[i:i + w] for i in range(len(f) - w + 1)}
            if any(skel[i:i + w] in grams[j] for i in range(max(0, fe - w), min(fs, len(skel) - w) + 1)):
                out[s:e] = "\ufffd" * (e - s)
                break
    return "".join(out)
