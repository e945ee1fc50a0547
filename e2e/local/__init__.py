"""A local Kubernetes cluster for the end-to-end tests, without Docker or a kubelet.

What belongs here: starting the real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler
v1.28.0) on 127.0.0.1 (``cluster``), the *process node agent* that registers a Node and runs pods as host
processes on loopback addresses (``node_agent``), the loopback Service proxies (``service_proxy``), the pytest
fixtures (``fixtures``) and the CLI (``python -m e2e.local up|down|env``). What does not: Fulcrum's product code,
and any test scenario (those live in ``e2e/test_*.py``). See docs/e2e.md.
"""
