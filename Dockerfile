# The diloco image: every process of a federation (coordinator, islands, `diloco status`) from one entrypoint.
#
#   docker build -t REGISTRY/diloco:TAG .                                  CPU JAX (the coordinator, CPU islands)
#   docker build --build-arg JAX_EXTRA=cuda12 -t REGISTRY/diloco:TAG-cuda .   islands on NVIDIA GPUs
#   docker build --build-arg JAX_EXTRA=tpu -t REGISTRY/diloco:TAG-tpu .       islands on TPU nodes
#   docker build --build-arg EXTRAS=pathways -t REGISTRY/diloco:TAG-pathways .   islands on Pathways slices
#
# Dependencies are the versions CI tested (constraints.txt). The user (uid 10001) and WORKDIR (/app) are the ones
# the Kubernetes manifests of `diloco deploy k8s` expect (diloco/deploy/k8s.py: USER_ID, WORKDIR): relative paths of
# a config (configs/links/..., file:kit/secrets/NAME) resolve against /app. README.md, "Kubernetes".
FROM python:3.11-slim

ARG JAX_EXTRA=""
ARG EXTRAS=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

COPY pyproject.toml README.md constraints.txt /src/
COPY diloco /src/diloco
COPY floor /src/floor
COPY islands /src/islands
COPY outer_optimizer /src/outer_optimizer
COPY pytrees /src/pytrees
COPY transport /src/transport
RUN pip install -c /src/constraints.txt "/src${EXTRAS:+[$EXTRAS]}" ${JAX_EXTRA:+"jax[$JAX_EXTRA]"} \
    && rm -rf /src

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin diloco
WORKDIR /app
COPY configs ./configs
USER 10001:10001

ENTRYPOINT ["diloco"]
CMD ["--help"]
