# tidemark container image.
#
#   docker build -t tidemark .
#   docker run --rm -p 8787:8787 -p 9787:9787 -e TIDEMARK_ADMIN_TOKEN=... \
#       tidemark --upstream https://api.openai.com
#
# Inside the container both listeners bind 0.0.0.0 (TIDEMARK_LISTEN /
# TIDEMARK_ADMIN_LISTEN below), so tidemark starts only with an admin token
# (TIDEMARK_ADMIN_TOKEN) or TIDEMARK_ADMIN_INSECURE=true (a network you trust).

# ---- build -----------------------------------------------------------------
# rustc 1.95.0, as rust-toolchain.toml pins: pgo/'s profile is used only
# with the compiler it was made with (scripts/rustc-wrapper); another builds
# correctly, without it.
FROM rust:1.95.0-bookworm AS builder
WORKDIR /src

# Dependency layer: build every dependency against stub sources so that a
# change to tidemark's own code does not rebuild the crates.io graph.
COPY Cargo.toml Cargo.lock rust-toolchain.toml ./
COPY .cargo .cargo
COPY scripts/rustc-wrapper scripts/rustc-wrapper
COPY pgo pgo
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

# The real sources. The stub's fingerprint is removed and the sources touched
# so cargo never mistakes the stub build for an up-to-date one.
COPY . .
RUN rm -rf target/release/.fingerprint/tidemark-* \
    && find src -name '*.rs' -exec touch {} + \
    && cargo build --release --locked \
    && install -Dm755 target/release/tidemark /out/tidemark

# ---- runtime ---------------------------------------------------------------
FROM debian:bookworm-slim

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 tidemark \
    && useradd --system --uid 10001 --gid tidemark --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin tidemark

COPY --from=builder /out/tidemark /usr/local/bin/tidemark

# Listen on every interface inside the container; flags still override.
ENV TIDEMARK_LISTEN=0.0.0.0:8787 \
    TIDEMARK_ADMIN_LISTEN=0.0.0.0:9787

USER 10001:10001
EXPOSE 8787 9787

# /healthz needs no token. bash's /dev/tcp keeps curl out of the image.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9787 && printf 'GET /healthz HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && head -n1 <&3 | grep -q ' 200 '"]

ENTRYPOINT ["tidemark"]
