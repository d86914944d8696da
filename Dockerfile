# Tiergate gateway image. `docker run -p 8080:8080 tiergate` runs the demo (two emulated tiers, no keys);
# for real upstreams: docker run -e CEREBRAS_API_KEY -e OPENAI_API_KEY -p 8080:8080 tiergate \
#   tiergate serve --host 0.0.0.0 --config /app/config/gateway.yaml
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY config ./config
RUN pip install . && useradd --system --uid 10001 tiergate && install -d -o tiergate /var/lib/tiergate
# the gateway keys' spend, kept across restarts (gateway.ledger_file); mount a volume here to keep it across containers
ENV GATEWAY_STATE_DIR=/var/lib/tiergate
USER tiergate
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/readyz').status != 200)"
CMD ["tiergate", "demo", "--host", "0.0.0.0", "--port", "8080"]
