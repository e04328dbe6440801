# Stand-in for redis:7.4.2-bookworm where no registry is reachable: Debian's redis-server on the
# local base, laid out as the official image is (uid 999 owns /data, the working directory).
ARG BASE
FROM ${BASE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /data && chown 999:999 /data
WORKDIR /data
VOLUME /data
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
