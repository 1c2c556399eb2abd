"""Text for the guide voice: English normalisation (segments of bounded length: `app.text.segment`).

Languages: English ("en", "en-GB", ...; the default) is normalised - numbers (cardinals,
ordinals, years, decades, decimals, percentages, fractions, ranges, times, currency), common
abbreviations (Mr., Dr., St., e.g., i.e., etc., months, units, compass points ...), Roman numerals after
Chapter/Part/Book and after names ("Henry VIII"), and punctuation. Any other language passes
through unnormalised: Unicode (NFKC) and whitespace clean-up only, then sentence splitting on
. ! ? ; and their CJK forms. Hostile input cannot make it slow: every pattern runs in linear time.
"""

from __future__ import annotations

import re
import unicodedata

from app.text import numbers as num


def is_english(language: str) -> bool:
    return language.lower().split("-")[0] in ("en", "")


# --- normalisation -------------------------------------------------------------------------------

_UNICODE = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201a": "'", "\u201b": "'", "\u2032": "'",
                          "\u201c": '"', "\u201d": '"', "\u201e": '"', "\u00ab": '"', "\u00bb": '"',
                          "\u2013": "-", "\u2014": " - ", "\u2015": " - ", "\u2026": "...",
                          "\u00a0": " ", "\u00ad": None, "\u200b": None, "\ufeff": None})

_TITLES = {"Mr": "Mister", "Mrs": "Missus", "Ms": "Miz", "Prof": "Professor", "Capt": "Captain",
           "Gen": "General", "Col": "Colonel", "Lt": "Lieutenant", "Sgt": "Sergeant", "Rev": "Reverend",
           "Hon": "Honorable", "Mt": "Mount", "Fr": "Father", "vs": "versus", "Vol": "Volume",
           "pp": "pages", "Fig": "Figure", "fig": "figure"}
# May end a sentence: keep the period when a capital or the end of the text follows.
_TRAILING = {"etc": "et cetera", "Jr": "Junior", "Sr": "Senior", "Ave": "Avenue", "Blvd": "Boulevard",
             "Rd": "Road", "Co": "Company", "Inc": "Incorporated", "Ltd": "Limited",
             "approx": "approximately", "lbs": "pounds", "lb": "pound", "oz": "ounces", "ft": "feet",
             "a.m": "A M", "p.m": "P M", "A.M": "A M", "P.M": "P M",
             "Jan": "January", "Feb": "February", "Mar": "March", "Apr": "April", "Jun": "June",
             "Jul": "July", "Aug": "August", "Sep": "September", "Sept": "September", "Oct": "October",
             "Nov": "November", "Dec": "December"}
_PHRASES = {"e.g.": "for example", "i.e.": "that is", "cf.": "compare", "viz.": "namely"}

_TITLE_RE = re.compile(r"\b(" + "|".join(_TITLES) + r")\.(?=\s)")
_TRAILING_RE = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in _TRAILING) + r")\.")
_PHRASE_RE = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in _PHRASES) + r")(,?)")
_SAINT_DOCTOR_RE = re.compile(r"\b(St|Dr)\.(?=( [A-Z])?)")
_NUMBER_SIGN_RE = re.compile(r"\b(No|Nos|no)\.\s*(?=\d)")
_INITIAL_RE = re.compile(r"\b([B-HJ-Z])\.(?=\s*[A-Z])")
# Compass points, dotted ("N.N.E.", "S.W.") or as the three-letter points ("WSW"): before the initials
# rule, which would read "N.N.E." as initials ("NNE.").
_COMPASS = {"N": "north", "S": "south", "E": "east", "W": "west"}
_POINTS = {"NE", "NW", "SE", "SW", "NNE", "ENE", "ESE", "SSE", "SSW", "WSW", "WNW", "NNW"}
_COMPASS_RE = re.compile(r"(?<![\w.])(?:((?:[NSEW]\.){2,3})|(NNE|ENE|ESE|SSE|SSW|WSW|WNW|NNW))(?!\w)")
_ROMAN_RE = re.compile(r"\b(Chapter|Part|Book|Volume|Act|Scene|Section|CHAPTER|PART|BOOK)\s+([IVXLCDM]+)\b")
# "Henry VIII", "World War II": I/V/X numerals of two letters or more after a capitalised word (not "I").
_REGNAL_RE = re.compile(r"\b([A-Z][a-z]+) ([IVX]{2,6})\b")
_RANGE_RE = re.compile(r"(?<![\d-])(\d+)-(\d+)(?![\d-])")  # "pages 45-67" -> 45 to 67
_FRACTION_RE = re.compile(r"(?<![\d/])(\d{1,3})/(\d{1,3})(?![\d/])")
_HASH_NUMBER_RE = re.compile(r"#(?=\d)")
_MONEY_RE = re.compile(r"([$£€¥])\s?(\d[\d,]*(?:\.\d+)?)(?:\s?(thousand|million|billion|trillion)\b)?")
_PERCENT_RE = re.compile(r"(?<![\d,.])(\d[\d,]*(?:\.\d+)?)\s?%")
_ORDINAL_RE = re.compile(r"\b(\d+)(st|nd|rd|th)\b", re.IGNORECASE)
_DECADE_RE = re.compile(r"\b(1[1-9]\d0|20\d0)'?s\b")
_SHORT_DECADE_RE = re.compile(r"'([2-9]0)s\b")
_TIME_RE = re.compile(r"\b([01]?\d|2[0-3]):([0-5]\d)\b")
_YEAR_RE = re.compile(r"(?<![\d,.])(1\d\d\d|20\d\d)(?!\d|[,.]\d)")
_NUMBER_RE = re.compile(r"(?<![\w.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\w)")
_STRAY_DIGITS_RE = re.compile(r"\d+")
_REPEATS_RE = re.compile(r"([^\w\s])\1{3,}")


def _keep_period(text: str, end: int) -> str:
    rest = text[end:].lstrip()
    return "." if not rest or rest[0].isupper() else ""


def _abbreviations(text: str) -> str:
    text = _NUMBER_SIGN_RE.sub(lambda m: "numbers " if m.group(1) == "Nos" else "number ", text)
    text = _PHRASE_RE.sub(lambda m: _PHRASES[m.group(1)] + m.group(2), text)
    text = _TITLE_RE.sub(lambda m: _TITLES[m.group(1)], text)

    def saint_doctor(m: re.Match[str]) -> str:
        abbr, name_follows = m.group(1), m.group(2) is not None
        before = m.string[max(0, m.start() - 40):m.start()].rstrip().rpartition(" ")[2]
        after_name = bool(before) and before[0].isupper() and before[-1].isalpha()
        if name_follows and not after_name:  # "Dr. Watson", "St. Paul"
            return "Doctor" if abbr == "Dr" else "Saint"
        word = "Drive" if abbr == "Dr" else "Street"  # "Baker St."
        return f"{word}{_keep_period(m.string, m.end())}"

    text = _COMPASS_RE.sub(_compass, text)
    text = _SAINT_DOCTOR_RE.sub(saint_doctor, text)
    text = _TRAILING_RE.sub(lambda m: _TRAILING[m.group(1)] + _keep_period(m.string, m.end()), text)
    return _INITIAL_RE.sub(r"\1", text)  # "J. R. R. Tolkien": not three sentences


def _compass(m: re.Match[str]) -> str:
    letters = (m.group(1) or m.group(2)).replace(".", "")
    if letters not in _POINTS:  # "E.S.": not a point of the compass
        return m.group(0)
    spoken = "-".join(_COMPASS[c] for c in letters)  # "north-north-east"
    return spoken + (_keep_period(m.string, m.end()) if m.group(1) else "")


def _plain_number(m: re.Match[str]) -> str:
    sign, whole, frac = m.group(1), m.group(2), m.group(3) or ""
    words = num.decimal(whole + frac) if len(whole.replace(",", "")) <= 15 else num.digits(whole + frac)
    return ("minus " if sign else "") + words


def _numbers(text: str) -> str:
    text = _ROMAN_RE.sub(lambda m: f"{m.group(1)} {num.cardinal(num.roman_to_int(m.group(2)) or 0)}"
                         if num.roman_to_int(m.group(2)) else m.group(0), text)
    text = _REGNAL_RE.sub(_regnal, text)
    text = _HASH_NUMBER_RE.sub("number ", text)
    text = _MONEY_RE.sub(lambda m: num.money(m.group(1), m.group(2), m.group(3)), text)
    text = _FRACTION_RE.sub(lambda m: num.fraction(int(m.group(1)), int(m.group(2))), text)
    text = _RANGE_RE.sub(r"\1 to \2", text)
    text = _PERCENT_RE.sub(lambda m: num.decimal(m.group(1)) + " percent", text)
    text = _ORDINAL_RE.sub(lambda m: num.ordinal(int(m.group(1))), text)
    text = _DECADE_RE.sub(lambda m: num.plural(num.year(int(m.group(1)))), text)
    text = _SHORT_DECADE_RE.sub(lambda m: num.plural(num.cardinal(int(m.group(1)))), text)
    text = _TIME_RE.sub(_time, text)
    text = _YEAR_RE.sub(lambda m: num.year(int(m.group(1))), text)
    text = _NUMBER_RE.sub(_plain_number, text)
    return _STRAY_DIGITS_RE.sub(lambda m: " " + num.digits(m.group(0)) + " ", text)


def _regnal(m: re.Match[str]) -> str:
    value = num.roman_to_int(m.group(2))
    if value is None:
        return m.group(0)
    spoken = num.cardinal(value) if m.group(1) == "War" else f"the {num.ordinal(value)}"
    return f"{m.group(1)} {spoken}"


def _time(m: re.Match[str]) -> str:
    hours, minutes = int(m.group(1)), int(m.group(2))
    if minutes == 0:
        return f"{num.cardinal(hours)} o'clock"
    tail = f"oh {num.cardinal(minutes)}" if minutes < 10 else num.cardinal(minutes)
    return f"{num.cardinal(hours)} {tail}"


_SPACES_RE = re.compile(r"\s+")
_PUNCT_STEPS = (
    (re.compile(r"[\"*_#~`|<>\[\]{}\\^/]"), " "),  # markup, quotes and slashes are not spoken
    (_SPACES_RE, " "),  # (again, so no pattern below meets a long run of spaces)
    (re.compile(r" ?[()] ?"), ", "),  # a parenthesis reads as a comma pause
    (re.compile(r" ?& ?"), " and "),
    (re.compile(r"(?<= )-(?= )|--+"), ","),  # a dash between words is a pause
    (re.compile(r"\.{3,}(?= [a-z])"), ","),  # trailing off mid-sentence
    (re.compile(r"\.{3,}"), "."),
    (re.compile(r"([!?])[!?.]+"), r"\1"),
    (re.compile(r"([,;:])[,;:]+"), r"\1"),
    (_SPACES_RE, " "),
    (re.compile(r" ([,.;:!?])"), r"\1"),
    (re.compile(r"([,;:])([,.;:!?])"), r"\2"),
    (re.compile(r"([.!?])[,;:]"), r"\1"),
    (re.compile(r"([,.;:!?])(?=[^\s\d,.;:!?'])"), r"\1 "),
    (_SPACES_RE, " "),
)


def _punctuation(text: str) -> str:
    for pattern, repl in _PUNCT_STEPS:
        text = pattern.sub(repl, text)
    return text.strip(" ,;:").lstrip(".").strip()


def normalise(text: str, language: str = "en") -> str:
    """Text as the guide voice should read it; see the module docstring for what is done."""
    text = unicodedata.normalize("NFKC", text).translate(_UNICODE)
    text = "".join(c if c.isprintable() else " " for c in text)
    # One space between words and at most three of any symbol in a row: every later pattern then
    # sees short runs, so none of them can backtrack quadratically on hostile input.
    text = _REPEATS_RE.sub(r"\1\1\1", _SPACES_RE.sub(" ", text)).strip()
    if not is_english(language):
        return text
    return _punctuation(_numbers(_abbreviations(text)))
