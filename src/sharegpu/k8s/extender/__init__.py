"""The scheduler extender: the kube-scheduler's verbs (filter, prioritize, preempt, bind) over HTTP, decided on the
cluster cache's ledgers, with leader election and DRA steering."""
