"""Print the README's configuration table from `app.settings.Settings` (the README is checked against it).

    python scripts/settings_table.py            # print the table
    python scripts/settings_table.py --write    # replace the table between the README's markers
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic_core import PydanticUndefined

from app.settings import Settings

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- settings-table:begin -->", "<!-- settings-table:end -->"


def _default(field) -> str:
    value = field.default
    if value is PydanticUndefined or value is None:
        return "unset"
    if value == "":
        return "(derived)"
    return f"`{value}`"


def render() -> str:
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `WAVEFARM_{name.upper()}` | {_default(field)} | {meaning} |")
    return "\n".join(rows)


def readme_table(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def main(argv: list[str]) -> int:
    table = render()
    if "--write" in argv:
        text = README.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        README.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
