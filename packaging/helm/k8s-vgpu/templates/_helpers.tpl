{{/* Names and labels shared by every template. */}}
{{- define "k8s-vgpu.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "k8s-vgpu.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; objects with a selector add k8s-vgpu.selector beside them. */}}
{{- define "k8s-vgpu.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: k8s-vgpu
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "k8s-vgpu.instanceLabels" -}}
{{ include "k8s-vgpu.labels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "k8s-vgpu.selector" -}}
app.kubernetes.io/name: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "k8s-vgpu.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "k8s-vgpu.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-device-plugin" (include "k8s-vgpu.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Scheduling shared by both DaemonSets. */}}
{{- define "k8s-vgpu.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.daemonRuntimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* vgpu-node-setup's flags, shared by the install init container and the uninstall hook. */}}
{{- define "k8s-vgpu.nodeSetupArgs" -}}
- --host-root=/host
- --prefix={{ .Values.nodeSetup.prefix }}
- --containerd-config={{ .Values.nodeSetup.containerdConfig }}
- --handler={{ .Values.runtimeClass.handler }}
- --state-dir={{ .Values.stateDir }}
{{- if .Values.nodeSetup.withoutNvidiaRuntime }}
- --without-nvidia-runtime
{{- end }}
{{- range .Values.nodeSetup.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
