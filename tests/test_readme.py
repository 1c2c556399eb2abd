"""The README tells the truth: its two commands, its configuration table, what CI runs."""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import settings_table  # noqa: E402

README = (REPO / "README.md").read_text()


def test_first_screen_gives_exactly_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["./run demo", "./run test"]
    assert README.index(first_block) < 1200  # on the first screen


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^exec \./run test$", ci, re.M)


def test_configuration_table_matches_the_settings():
    assert settings_table.readme_table(README) == settings_table.render()


def test_every_wavefarm_variable_named_in_the_readme_exists():
    from app.settings import Settings

    known = {f"WAVEFARM_{name.upper()}" for name in Settings.model_fields}
    named = set(re.findall(r"WAVEFARM_[A-Z_]+", README))
    assert named <= known, named - known


def test_every_cli_command_in_the_readme_exists():
    from app.cli import build_parser

    parser = build_parser()
    subcommands = set(parser._subparsers._group_actions[0].choices)
    used = set(re.findall(r"^\./run ([a-z-]+)", README, re.M))
    used |= set(re.findall(r"\| +\./run ([a-z-]+)", README))
    assert used - {"test", "demo"} <= subcommands, used - subcommands


def test_the_readme_gives_the_postgresql_url_form_with_the_installed_driver():
    from sqlalchemy.engine import make_url

    urls = re.findall(r"WAVEFARM_DATABASE_URL=(postgresql\S*)", README)
    assert urls, "no PostgreSQL URL in the README"
    for url in urls:
        assert make_url(url).get_dialect().driver == "psycopg", url  # psycopg 3, a dependency
