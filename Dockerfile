# wavefarm: one image for every role (api, cpu-worker, gpu-worker, flower, migrate); the compose
# service's command picks the role. torch from PyPI ships its CUDA runtime; the host needs the NVIDIA
# driver and container toolkit for the gpu-worker only. espeak-ng: the books' guide voice falls back to it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends libsndfile1 espeak-ng \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /srv/wavefarm

# Dependencies first, from pyproject alone: the slow layer (torch) is reused while the code changes.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt

# Editable install: migrations/ and app/dev/samples/ are read from the source tree.
COPY . .
RUN pip install --no-deps -e . \
 && useradd --system --uid 10001 --home-dir /srv/wavefarm wavefarm \
 && mkdir -p /data && chown wavefarm /data

USER wavefarm
EXPOSE 8000 5555
CMD ["wavefarm", "serve", "--host", "0.0.0.0", "--port", "8000"]
