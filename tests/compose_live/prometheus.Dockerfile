# Stand-in for prom/prometheus:v3.1.0: Debian bookworm's Prometheus server (2.42), with the
# upstream image's entrypoint and a /prometheus data directory the nobody user can write
# (compose.yaml's command passes --config.file and --storage.tsdb.path=/prometheus).
FROM local/debian:bookworm
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup -m 0755 /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
