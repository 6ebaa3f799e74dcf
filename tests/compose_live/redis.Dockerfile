# Stand-in for redis:7.4: Debian bookworm's Redis (7.0) and redis-cli (the healthcheck), run as
# the redis user. compose.yaml's command starts with redis-server.
FROM local/debian:bookworm
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        redis-server redis-tools \
 && rm -rf /var/lib/apt/lists/*
USER redis
WORKDIR /var/lib/redis
EXPOSE 6379
CMD ["redis-server"]
