# Stand-in for prom/prometheus where no registry is reachable: Debian's prometheus on the local base,
# laid out as the official image is (runs as nobody, /prometheus owned by it, the binary as entrypoint).
ARG BASE
FROM ${BASE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /prometheus && chown 65534:65534 /prometheus
USER 65534:65534
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
