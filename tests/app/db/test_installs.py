"""Worker install rows: pins, unpins and the order of last use."""

from sqlalchemy.orm import Session

from app.db import queries as q
from tests.app.db.helpers import vid


def test_worker_installs_pin_unpin_and_order_by_last_use(session: Session, voice: str):
    q.get_or_create_voice(session=session, voice_id=vid(1), reference_path="references/z.wav")
    q.record_install(session=session, worker_id="gpu0", voice_id=voice, nbytes=100)
    q.record_install(session=session, worker_id="gpu0", voice_id=vid(1), nbytes=200)
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=vid(1), delta=-1)  # never below 0
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=voice)
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=voice)
    q.pin_worker_voice(session=session, worker_id="gpu0", voice_id=voice, delta=-1)
    session.commit()
    rows = q.list_worker_voices(session=session, worker_id="gpu0")
    assert [r.voice_id for r in rows] == [vid(1), voice]  # least recently used first
    assert {r.voice_id: r.pinned for r in rows} == {voice: 1, vid(1): 0}
    assert q.remove_worker_voice(session=session, worker_id="gpu0", voice_id=vid(1))
    assert not q.remove_worker_voice(session=session, worker_id="gpu0", voice_id=vid(1))
    assert q.clear_worker_voices(session=session, worker_id="gpu0") == 1
    session.commit()
    assert q.list_worker_voices(session=session, worker_id="gpu0") == []


def test_install_events_keep_every_install_and_how_it_ended(session: Session, voice: str):
    q.get_or_create_voice(session=session, voice_id=vid(1), reference_path="references/z.wav")
    q.record_install(session=session, worker_id="gpu0", voice_id=voice, nbytes=100)
    q.record_install(session=session, worker_id="gpu1", voice_id=voice, nbytes=100)
    q.remove_worker_voice(session=session, worker_id="gpu0", voice_id=voice)  # evicted
    q.record_install(session=session, worker_id="gpu0", voice_id=voice, nbytes=120)  # installed again
    q.record_install(session=session, worker_id="gpu0", voice_id=vid(1), nbytes=50)
    q.clear_worker_voices(session=session, worker_id="gpu0")  # its process ended holding both
    session.commit()
    events = q.list_install_events(session=session, worker_id="gpu0")
    assert [(e.voice_id, e.nbytes, e.evicted_at is not None, e.lost) for e in events] == [
        (voice, 100, True, False), (voice, 120, True, True), (vid(1), 50, True, True)]
    (still,) = q.list_install_events(session=session, worker_id="gpu1")
    assert still.evicted_at is None and not still.lost
    assert len(q.list_install_events(session=session)) == 4
