{{/* Names shared by the scheduler and webhook templates (scheduler-*.yaml, webhook-*.yaml). */}}
{{- define "k8s-vgpu.scheduler.fullname" -}}
{{- printf "%s-scheduler" (include "k8s-vgpu.fullname" .) -}}
{{- end -}}

{{- define "k8s-vgpu.webhook.fullname" -}}
{{- printf "%s-webhook" (include "k8s-vgpu.fullname" .) -}}
{{- end -}}

{{- define "k8s-vgpu.webhook.secret" -}}
{{- printf "%s-webhook-tls" (include "k8s-vgpu.fullname" .) -}}
{{- end -}}

{{/* kube-scheduler's image tag: the value, else the cluster's version without build suffixes (v1.30.4+k3s1 -> v1.30.4). */}}
{{- define "k8s-vgpu.kubeSchedulerTag" -}}
{{- if .Values.scheduler.kubeScheduler.imageTag -}}
{{- .Values.scheduler.kubeScheduler.imageTag -}}
{{- else -}}
{{- include "k8s-vgpu.kubeVersion" . | splitList "+" | first | splitList "-" | first -}}
{{- end -}}
{{- end -}}

{{/* The cluster's Kubernetes version: the kubeVersion value, else what Helm was told. */}}
{{- define "k8s-vgpu.kubeVersion" -}}
{{- default .Capabilities.KubeVersion.Version .Values.kubeVersion -}}
{{- end -}}

{{/* "true" where MutatingWebhook matchConditions exist (beta and on by default in 1.28, GA in 1.30). */}}
{{- define "k8s-vgpu.webhook.matchConditions" -}}
{{- if semverCompare ">=1.28-0" (include "k8s-vgpu.kubeVersion" .) }}true{{ end -}}
{{- end -}}

{{/* The webhook's CEL matchCondition: a container (init or app) names a vGPU resource in its
     limits or requests.  docs/operators/scheduling.md quotes it. */}}
{{- define "k8s-vgpu.webhook.condition" -}}
has(object.spec) && ((has(object.spec.containers) ? object.spec.containers : []) +
    (has(object.spec.initContainers) ? object.spec.initContainers : [])).exists(c,
  has(c.resources) &&
  ['{{ .Values.resourceName }}', 'nvidia.com/gpumem', 'nvidia.com/gpumem-percentage', 'nvidia.com/gpucores'].exists(r,
    (has(c.resources.limits) && r in c.resources.limits) ||
    (has(c.resources.requests) && r in c.resources.requests)))
{{- end -}}

{{/* Flags the extender and the webhook share: the same sizing rules on both. */}}
{{- define "k8s-vgpu.scheduler.args" -}}
- --scheduler-name={{ .Values.scheduler.name }}
- --resource-name={{ .Values.resourceName }}
- --node-policy={{ .Values.scheduler.nodePolicy }}
- --gpu-policy={{ .Values.scheduler.gpuPolicy }}
- --default-gpumem-mib={{ int .Values.scheduler.defaultGpumemMiB }}
- --default-gpucores={{ int .Values.scheduler.defaultGpucores }}
- --default-gpu-count={{ int .Values.scheduler.defaultGpuCount }}
- --{{ if not .Values.scheduler.overwriteDefaultScheduler }}no-{{ end }}overwrite-default-scheduler
- --{{ if not .Values.scheduler.webhook.refuseOversized }}no-{{ end }}refuse-oversized
- --log-level={{ .Values.scheduler.logLevel }}
{{- end -}}

{{/* kube-scheduler's Lease (KubeSchedulerConfiguration leaderElection.resourceName), followed by the extender. */}}
{{- define "k8s-vgpu.scheduler.lease" -}}
{{- printf "%s-kube-scheduler" (include "k8s-vgpu.scheduler.fullname" .) -}}
{{- end -}}
