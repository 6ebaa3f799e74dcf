# Stand-in for python:3.11-slim-bookworm (no image registry is reachable where the live compose
# test runs): Debian bookworm's own Python 3.11 on a debootstrap'ed base imported as
# local/debian:bookworm. The Dockerfiles need python3 with venv, Python's headers (kvtier's C
# extension) and useradd.
FROM local/debian:bookworm
# apt rewrites /etc/ssl/certs/ca-certificates.crt when it installs anything; the host's bundle
# (which may hold the CA of a TLS-intercepting mirror or proxy) is kept apart and pip and
# Python's ssl are pointed at it.
COPY host-ca.crt /etc/ssl/host-ca.crt
ENV PIP_CERT=/etc/ssl/host-ca.crt SSL_CERT_FILE=/etc/ssl/host-ca.crt
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev passwd \
 && rm -rf /var/lib/apt/lists/*
