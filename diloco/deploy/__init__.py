"""Deployment: Kubernetes manifests and TLS material."""
