"""Wrap runs of an XHTML block's text in <span id>s, keeping its other markup: the read-along EPUB of an
EPUB source highlights each spoken segment inside the book's own paragraphs.

    visible(el)                        the text a reader of the block sees (<br> as a space; script,
                                       style, ruby annotations ... left out, as the EPUB reader leaves them)
    wrap_runs(block, runs, tag) -> ids each run (start, end, id), counted in non-whitespace characters of
                                       `visible(block)`, wrapped in a <tag id=...>; returns the id each
                                       run ended up in

Runs are cut exactly inside the block's own text. A run that starts or ends inside a child element (an
<em>, a link) is widened to take the whole element, since an element cannot be split without changing the
book's markup; a run that the widening makes overlap the run before it is merged into that one (the
returned ids say so). Counting non-whitespace characters makes the match indifferent to how the reader
joined or collapsed whitespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

from lxml import etree

SKIPPED = {"script", "style", "head", "title", "rt", "rp", "svg", "math", "nav", "template"}
BREAKS = {"br", "hr"}

Item: TypeAlias = Any  # a block's content at its own level: a text piece (str) or a child element


def local(el: etree._Element) -> str:
    """An element's name without its namespace ("" for comments and processing instructions)."""
    return etree.QName(el).localname if isinstance(el.tag, str) else ""


def visible(el: etree._Element) -> str:
    if not isinstance(el.tag, str) or local(el) in SKIPPED:
        return ""
    if local(el) in BREAKS:
        return " "
    return (el.text or "") + "".join(visible(child) + (child.tail or "") for child in el)


def nonspace(text: str) -> str:
    return "".join(text.split())


def wrap_runs(block: etree._Element, runs: Sequence[tuple[int, int, str]], tag: str) -> list[str]:
    items = _take_items(block)
    starts = _bounds(items, [(s, True) for s, _, _ in runs] + [(e, False) for _, e, _ in runs])
    items, where = _split(items, starts)
    placed: list[tuple[int, int, str]] = []  # (first item, end item, id), in order, not overlapping
    ids = []
    for (s, e, run_id), start_key, end_key in zip(runs, starts[:len(runs)], starts[len(runs):], strict=True):
        first, end = where[start_key], where[end_key]
        if s >= e or first >= end:
            ids.append(placed[-1][2] if placed else run_id)
            continue
        if placed and first < placed[-1][1]:  # widened into the run before it: one span for both
            placed[-1] = (placed[-1][0], max(end, placed[-1][1]), placed[-1][2])
            ids.append(placed[-1][2])
            continue
        placed.append((first, end, run_id))
        ids.append(run_id)
    _rebuild(block, items, placed, tag)
    return ids


def _take_items(block: etree._Element) -> list[Item]:
    """The block's text, each child and each child's tail, in order; the block emptied of them."""
    items: list[Item] = [block.text or ""]
    for child in list(block):
        items += [child, child.tail or ""]
        child.tail = None
        block.remove(child)
    block.text = None
    return items


Bound = tuple[int, int]  # (item, character offset in it); for an element item the offset is 0 or 1 (after)


def _bounds(items: Sequence[Item], marks: Iterable[tuple[int, bool]]) -> list[Bound]:
    """Each mark (a count of non-whitespace characters, and whether it starts a run) as a place among the
    items: inside a text item exactly, before or after an element item (widened)."""
    spots: list[tuple[int, int | None]] = []  # the non-whitespace characters: (item, offset or None)
    for i, item in enumerate(items):
        if isinstance(item, str):
            spots += [(i, k) for k, ch in enumerate(item) if not ch.isspace()]
        else:
            spots += [(i, None)] * len(nonspace(visible(item)))
    out = []
    for mark, is_start in marks:
        if is_start:
            i, k = spots[mark] if mark < len(spots) else (len(items), 0)
            out.append((i, k or 0))
        else:
            i, k = spots[mark - 1] if mark > 0 else (0, -1)
            out.append((i, k + 1) if k is not None else (i, 1))
    return out


def _split(items: list[Item], bounds: Sequence[Bound]) -> tuple[list[Item], dict[Bound, int]]:
    """Text items cut at every bound; returns the new items and, for each bound, the index of the first
    new item after it."""
    cuts: dict[int, set[int]] = {}
    for i, k in bounds:
        if i < len(items) and isinstance(items[i], str):
            cuts.setdefault(i, set()).add(k)
    out: list[Item] = []
    where: dict[Bound, int] = {}
    for i, item in enumerate(items):
        if isinstance(item, str):
            edges = sorted({0, len(item), *cuts.get(i, ())})
            for a, b in zip(edges, edges[1:], strict=False):
                where[(i, a)] = len(out)
                out.append(item[a:b])
            where[(i, len(item))] = len(out)
            where.setdefault((i, 0), len(out))
        else:
            where[(i, 0)] = len(out)
            out.append(item)
            where[(i, 1)] = len(out)
    where[(len(items), 0)] = len(out)
    return out, where


def _rebuild(block: etree._Element, items: list[Item], placed: list[tuple[int, int, str]], tag: str) -> None:
    runs = iter(placed)
    run = next(runs, None)
    i = 0
    while i < len(items):
        if run is not None and i == run[0]:
            span = etree.SubElement(block, tag, id=run[2])
            for item in items[run[0]:run[1]]:
                _append(span, item)
            i, run = run[1], next(runs, None)
            continue
        _append(block, items[i])
        i += 1


def _append(parent: etree._Element, item: Item) -> None:
    if not isinstance(item, str):
        parent.append(item)
    elif len(parent):
        parent[-1].tail = (parent[-1].tail or "") + item
    else:
        parent.text = (parent.text or "") + item
