# The stopline worker image: `stopline-worker` against $TEMPORAL_ADDRESS.
#
#   docker build -t stopline-worker .                          # plain
#   docker build --build-arg EXTRAS='[otel]' -t stopline-worker .   # with tracing
#   docker build --build-arg UID=$(id -u) -t stopline-worker .  # bind-mount a host workspace
#
# The worker runs as an unprivileged user: tool calls run the model's shell
# commands, which should not be root in the container. UID should match the
# owner of a bind-mounted workspace so the agent can edit it.
FROM python:3.11-slim

# git: agent tasks usually work on repositories; procps: ps/pkill for tool
# commands and for inspecting process groups when debugging; bubblewrap: the
# sandbox every tool command runs in (README, "The sandbox"; the container
# needs the security_opt of docker-compose.yml for it to work).
RUN apt-get update \
    && apt-get install -y --no-install-recommends git procps bubblewrap \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    STOPLINE_HOME=/data/stopline \
    STOPLINE_LOG_FORMAT=json

WORKDIR /app
COPY pyproject.toml README.md ./
COPY stopline ./stopline
ARG EXTRAS=""
RUN pip install ".${EXTRAS}"

ARG UID=10001
RUN useradd --create-home --uid "${UID}" stopline \
    && mkdir -p /data/stopline /workspace \
    && chown stopline /data/stopline /workspace
USER stopline

# SIGTERM starts a graceful shutdown (WORKER_SHUTDOWN_GRACE_S in
# stopline/worker/runtime.py); give the container longer than that to stop.
STOPSIGNAL SIGTERM
CMD ["stopline-worker"]
