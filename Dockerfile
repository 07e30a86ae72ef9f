# syntax=docker/dockerfile:1
# Tianmen gateway: CPU torch, the `tianmen` package, a non-root user, `tianmen serve` over TLS 1.3.
#
#   docker build -t tianmen:0.1.0 .                      (docker compose build does this with .env's TIANMEN_UID)
#   docker run -p 8443:8443 \
#     -v /srv/tianmen/tianmen.toml:/etc/tianmen/tianmen.toml:ro \
#     -v /srv/models:/models:ro -v /srv/tianmen/secrets:/run/secrets:ro -v tianmen-data:/var/lib/tianmen tianmen:0.1.0
#
# Models, keys and certificates are mounted read-only, never baked in. Files the gateway reads with
# mode 0600 (the KEK, the TLS key) must belong to TIANMEN_UID: build with --build-arg TIANMEN_UID=$(id -u)
# for secrets owned by you, or chown them to 10001.
#
# Ascend NPU image (documented, not built in CI): a CANN base image with Python 3.10+ and the CANN
# toolkit, torch pinned to the version the torch_npu release supports (torch_npu 2.x.y needs torch 2.x.y),
# the `npu` extra (torch_npu), and engine.device = "npu":
#
#   docker build -t tianmen:0.1.0-npu \
#     --build-arg BASE_IMAGE=ascendai/cann:<cann-version>-<chip>-ubuntu22.04-py3.11 \
#     --build-arg TORCH_VERSION=<torch version for torch_npu> \
#     --build-arg EXTRAS=npu .
#   docker run --device /dev/davinci0 --device /dev/davinci_manager --device /dev/devmm_svm --device /dev/hisi_hdc \
#     -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro -e TIANMEN_ENGINE_DEVICE=npu ... tianmen:0.1.0-npu
#
# TORCH_INDEX_URL stays the CPU wheel index there: torch_npu runs on the CPU build of torch.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a compiler for dependencies that ship no wheel for this platform and for libgcrypt 1.11; it stays in this stage
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential bzip2 \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index: the package's own `torch>=2.4` is then satisfied and no CUDA wheel is pulled
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# libgcrypt 1.11 + libgpg-error 1.51 from sha256-pinned sources into <venv>/opt/gcrypt, where security.gcrypt
# looks first (sys.prefix is /opt/venv); it travels with the venv. SM4 on GFNI/AVX-512: ~2.8x bookworm's 1.10.
COPY deploy/libgcrypt/build.sh /src/deploy/libgcrypt/build.sh
RUN --mount=type=cache,target=/root/.cache/tianmen-gcrypt bash /src/deploy/libgcrypt/build.sh /opt/venv/opt/gcrypt
COPY pyproject.toml README.md /src/
COPY gateway /src/gateway
COPY engine /src/engine
COPY security /src/security
COPY audit /src/audit
# the last check compiles one kernel from the installed package (the image compiles them again for its host at
# first start): a wheel without the kernels' headers once left every kernel unbuilt and the engine on torch alone
RUN pip install "/src${EXTRAS:+[$EXTRAS]}" \
 && python -c "import gateway.server, engine, security.sm4, audit" \
 && python -c "from security.gcrypt import BUNDLED, Gcrypt; g = Gcrypt.load(); assert g and g.path == str(BUNDLED), g" \
 && TIANMEN_KERNEL_CACHE=/tmp/kernels python -I -c "from engine.kernels import pointwise; assert pointwise.kernel()" \
 && rm -rf /tmp/kernels

FROM ${BASE_IMAGE}
ARG TIANMEN_UID=10001
ARG TIANMEN_GID=10001
# libgcrypt: chunk-parallel SM4 decryption of sealed weights (OpenSSL is the fallback); the venv brings 1.11,
# the system's 1.10 is the fallback should that one not load.
# gcc + libc6-dev: the engine compiles its bf16-weight kernel for the host CPU (-march=native) at first start,
# cached in $TIANMEN_HOME/.cache; an image can't carry a build tuned for the machine it will run on
# hadolint ignore=DL3008
RUN test "${TIANMEN_UID}" -ne 0 \
 && apt-get update \
 && apt-get install -y --no-install-recommends libgcrypt20 gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && (getent group "${TIANMEN_GID}" || groupadd --gid "${TIANMEN_GID}" tianmen) \
 && useradd --uid "${TIANMEN_UID}" --gid "${TIANMEN_GID}" --no-create-home --no-log-init \
      --home-dir /var/lib/tianmen --shell /usr/sbin/nologin tianmen \
 && install -d -m 0700 -o "${TIANMEN_UID}" -g "${TIANMEN_GID}" /var/lib/tianmen \
 && install -d -m 0755 /etc/tianmen /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TIANMEN_HOME=/var/lib/tianmen \
    TIANMEN_HEALTHCHECK_CA=/run/secrets/tls_ca

# state: the audit spool (the first hop of the audit trail: keep it), dev keys, profiler traces
VOLUME ["/var/lib/tianmen"]
WORKDIR /var/lib/tianmen
USER ${TIANMEN_UID}:${TIANMEN_GID}
EXPOSE 8443

# /health over TLS, checked against the CA that signed the server certificate
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import os, ssl, urllib.request as u; u.urlopen('https://localhost:8443/health', timeout=4, context=ssl.create_default_context(cafile=os.environ['TIANMEN_HEALTHCHECK_CA']))"]

ENTRYPOINT ["tianmen"]
CMD ["serve", "--config", "/etc/tianmen/tianmen.toml"]
