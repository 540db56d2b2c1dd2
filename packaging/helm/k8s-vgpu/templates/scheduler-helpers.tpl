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
{{- .Capabilities.KubeVersion.Version | splitList "+" | first | splitList "-" | first -}}
{{- end -}}
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
- --log-level={{ .Values.scheduler.logLevel }}
{{- end -}}

{{/* kube-scheduler's Lease (KubeSchedulerConfiguration leaderElection.resourceName), followed by the extender. */}}
{{- define "k8s-vgpu.scheduler.lease" -}}
{{- printf "%s-kube-scheduler" (include "k8s-vgpu.scheduler.fullname" .) -}}
{{- end -}}
