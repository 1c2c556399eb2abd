"""What the database tests share: voice ids and jobs made through the queries."""

import hashlib
import uuid

from sqlalchemy.orm import Session

from app.db import queries as q


def vid(n: int = 0) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def new_job(session: Session, voice_id: str, key: str | None = None, tokens=(1, 2, 3)):
    return q.create_job(session=session, new=q.NewJob(
        id=str(uuid.uuid4()), voice_id=voice_id, tokens=list(tokens), n_tokens=len(tokens), seed=7,
        output_format="wav", idempotency_key=key))
