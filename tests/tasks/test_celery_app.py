"""The Celery app's wire contract: JSON only, at-least-once delivery, queues and names."""

from app.settings import Settings
from tasks.celery_app import make_celery


def test_the_app_speaks_json_only_and_acknowledges_late():
    conf = make_celery(Settings(visibility_timeout_s=7200)).conf
    assert conf.accept_content == ["json"] and conf.result_accept_content == ["json"]
    assert conf.task_serializer == "json" and conf.result_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.worker_send_task_events and conf.task_send_sent_event
    assert conf.broker_transport_options["visibility_timeout"] == 7200


def test_tasks_are_routed_by_name_to_the_configured_queues():
    app = make_celery(Settings(queue_cpu="cpu-x", queue_gpu="gpu-x"))
    assert {q.name for q in app.conf.task_queues} == {"cpu-x", "gpu-x"}
    assert app.conf.task_routes == {"voice.prepare": {"queue": "cpu-x"}, "synth": {"queue": "gpu-x"}}
    assert app.main == "wavefarm"


def test_the_worker_entry_point_registers_voice_prepare_by_its_explicit_name():
    from tasks.celery_app import celery_app

    celery_app.loader.import_default_modules()
    assert "voice.prepare" in celery_app.tasks


def test_each_prefork_child_runs_torch_on_the_configured_threads(monkeypatch):
    import torch

    from tasks import celery_app as module

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(module, "get_settings", lambda: Settings(cpu_worker_threads=1))
        torch.set_num_threads(2)
        module.worker_process_init.send(sender=None)  # what Celery sends in each new child
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(module, "get_settings", lambda: Settings(cpu_worker_threads=0))
        torch.set_num_threads(2)
        module.limit_torch_threads()
        assert torch.get_num_threads() == 2  # 0: torch's own default is left alone
    finally:
        torch.set_num_threads(before)
