"""English number words: cardinals, ordinals, years, decimals, currency amounts.

Pure string functions used by `app.text.normalise`; American style ("one hundred five", no "and").
Other languages are not handled here: their digits pass through for the guide voice to read.
"""

from __future__ import annotations

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (1000, "thousand"))
_ORDINAL_WORDS = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
                  "nine": "ninth", "twelve": "twelfth"}
MAX_CARDINAL = 10**15  # above this, digits are read one by one

# symbol -> (singular, plural, cent singular, cent plural)
CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "€": ("euro", "euros", "cent", "cents"),
    "¥": ("yen", "yen", "sen", "sen"),
}


def cardinal(n: int) -> str:
    if n < 0:
        return "minus " + cardinal(-n)
    if n >= MAX_CARDINAL:
        return digits(str(n))
    if n < 20:
        return _ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")
    if n < 1000:
        hundreds, rest = divmod(n, 100)
        return f"{_ONES[hundreds]} hundred" + (f" {cardinal(rest)}" if rest else "")
    for value, name in _SCALES:
        if n >= value:
            high, rest = divmod(n, value)
            return f"{cardinal(high)} {name}" + (f" {cardinal(rest)}" if rest else "")
    raise AssertionError(n)  # unreachable: every n >= 1000 has a scale


def ordinal(n: int) -> str:
    words = cardinal(n)
    head, sep, last = words.rpartition(" ")
    if "-" in last:
        head2, _, last = last.rpartition("-")
        head, sep = (f"{head} {head2}" if head else head2), "-"
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return f"{head}{sep}{last}" if head else last


def year(n: int) -> str:
    """1066 -> ten sixty-six, 1905 -> nineteen oh five, 1900 -> nineteen hundred, 2005 -> two thousand five"""
    high, low = divmod(n, 100)
    if 2000 <= n <= 2009 or not 1000 <= n <= 9999 or (n < 1100 and low < 10):
        return cardinal(n)
    if low == 0:
        return f"{cardinal(high)} hundred"
    if low < 10:
        return f"{cardinal(high)} oh {cardinal(low)}"
    return f"{cardinal(high)} {cardinal(low)}"


def plural(words: str) -> str:
    """nineteen eighty -> nineteen eighties (decades)."""
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


def digits(text: str) -> str:
    return " ".join(_ONES[int(d)] for d in text if d.isdigit())


def decimal(text: str) -> str:
    """'3.14' -> three point one four; '1,234' -> one thousand two hundred thirty-four."""
    whole, _, frac = text.replace(",", "").partition(".")
    head = cardinal(int(whole)) if whole else "zero"
    if len(whole) > 1 and whole.startswith("0"):
        head = digits(whole)
    return f"{head} point {digits(frac)}" if frac else head


def money(symbol: str, amount: str, scale: str | None = None) -> str:
    """('$', '1,234.56') -> one thousand two hundred thirty-four dollars and fifty-six cents."""
    one, many, cent, cents = CURRENCIES[symbol]
    whole, _, frac = amount.replace(",", "").partition(".")
    if scale:  # "$2.5 million" -> two point five million dollars
        return f"{decimal(amount)} {scale} {many}"
    units = int(whole or "0")
    parts = []
    if units or not frac:
        parts.append(f"{cardinal(units)} {one if units == 1 else many}")
    if frac:
        hundredths = int((frac + "0")[:2])
        if hundredths:
            parts.append(f"{cardinal(hundredths)} {cent if hundredths == 1 else cents}")
        elif not parts:
            parts.append(f"zero {many}")
    return " and ".join(parts)


def fraction(numerator: int, denominator: int) -> str:
    """1/2 -> one half, 3/4 -> three quarters, 2/3 -> two thirds, 5/0 -> five over zero."""
    if denominator < 2:
        return f"{cardinal(numerator)} over {cardinal(denominator)}"
    name = {2: "half", 4: "quarter"}.get(denominator) or ordinal(denominator)
    if numerator != 1:
        name = "halves" if name == "half" else name + "s"
    return f"{cardinal(numerator)} {name}"


def roman_to_int(text: str) -> int | None:
    values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
    if not text or any(c not in values for c in text):
        return None
    total = 0
    for i, c in enumerate(text):
        v = values[c]
        total += -v if i + 1 < len(text) and values[text[i + 1]] > v else v
    return total if 0 < total < 4000 else None
