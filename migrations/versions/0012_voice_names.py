"""voices.name: a voice may have a unique name, usable wherever its id is

Revision ID: 0012_voice_names
Revises: 0011
Create Date: 2026-12-04

`wavefarm voices --add ref.wav --name Ada`, `PATCH /v1/voices/{id}` and the OpenAI-compatible
`voice` field name voices by what people call them instead of by their sha256. NULL: no name; a name
is unique (a unique constraint, so two concurrent renames cannot both win).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_voice_names"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("voices") as batch:
        batch.add_column(sa.Column("name", sa.String(64), nullable=True))
        batch.create_unique_constraint("uq_voices_name", ["name"])


def downgrade() -> None:
    with op.batch_alter_table("voices") as batch:
        batch.drop_constraint("uq_voices_name", type_="unique")
        batch.drop_column("name")
