//! The runtime `args`/`env` templates: Go `text/template` field references as the public Hearth
//! API writes them — `{{ .Model.Path }}`, `{{ .Service.Name }}`, `{{ .Service.Namespace }}` —
//! with or without spaces inside the braces. Nothing else is a template: no pipelines or
//! functions, so an unknown reference is an error rather than a silent empty string.

/// The values a template can reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateValues<'a> {
    /// `.Model.Path`: what the engine loads (see [`crate::model`]).
    pub model_path: &'a str,
    /// `.Service.Name`: the `LLMService` name.
    pub service_name: &'a str,
    /// `.Service.Namespace`: the `LLMService` namespace.
    pub service_namespace: &'a str,
}

/// Why a template did not render.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// `{{` without a closing `}}`.
    #[error("{field}: unclosed \"{{{{\" in {text:?}: close it with \"}}}}\"")]
    Unclosed {
        /// Where the template came from, e.g. `spec.container.args[0]`.
        field: String,
        /// The template text.
        text: String,
    },
    /// A reference other than the three supported ones.
    #[error(
        "{field}: unknown template reference {{{{ {reference} }}}}: use {{{{ .Model.Path }}}}, {{{{ .Service.Name }}}} or {{{{ .Service.Namespace }}}}"
    )]
    Unknown {
        /// Where the template came from.
        field: String,
        /// The reference as written, trimmed.
        reference: String,
    },
}

/// Renders one template string; `field` names its place in the `InferenceRuntime` for errors.
pub fn render(
    text: &str,
    values: &TemplateValues<'_>,
    field: &str,
) -> Result<String, TemplateError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or_else(|| TemplateError::Unclosed {
            field: field.to_owned(),
            text: text.to_owned(),
        })?;
        // Go's `{{- x -}}` trims surrounding space; accept the markers, trim only the action.
        let reference = after[..end]
            .trim()
            .trim_start_matches('-')
            .trim_end_matches('-')
            .trim();
        let value = match reference {
            ".Model.Path" => values.model_path,
            ".Service.Name" => values.service_name,
            ".Service.Namespace" => values.service_namespace,
            other => {
                return Err(TemplateError::Unknown {
                    field: field.to_owned(),
                    reference: other.to_owned(),
                });
            }
        };
        out.push_str(value);
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: TemplateValues<'static> = TemplateValues {
        model_path: "Qwen/Qwen2.5-7B-Instruct",
        service_name: "qwen",
        service_namespace: "ml",
    };

    #[test]
    fn renders_the_upstream_forms() {
        assert_eq!(
            render("{{ .Model.Path }}", &V, "a").unwrap(),
            "Qwen/Qwen2.5-7B-Instruct"
        );
        assert_eq!(
            render("--served-model-name={{ .Service.Name }}", &V, "a").unwrap(),
            "--served-model-name=qwen"
        );
        assert_eq!(
            render("--model={{.Model.Path}}", &V, "a").unwrap(),
            "--model=Qwen/Qwen2.5-7B-Instruct"
        );
        assert_eq!(
            render("{{ .Service.Name }}.{{ .Service.Namespace }}", &V, "a").unwrap(),
            "qwen.ml"
        );
        assert_eq!(render("--port=8000", &V, "a").unwrap(), "--port=8000");
        assert_eq!(render("{{- .Service.Name -}}", &V, "a").unwrap(), "qwen");
    }

    #[test]
    fn unknown_reference_names_field_and_fix() {
        let err = render("{{ .Model.Name }}", &V, "spec.container.args[2]").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("spec.container.args[2]: unknown template reference {{ .Model.Name }}"),
            "{msg}"
        );
        assert!(msg.contains("{{ .Model.Path }}"), "{msg}");
    }

    #[test]
    fn unclosed_is_an_error() {
        let err = render("--x={{ .Model.Path", &V, "spec.container.env[0].value").unwrap_err();
        assert!(matches!(err, TemplateError::Unclosed { .. }));
        assert!(
            err.to_string()
                .starts_with("spec.container.env[0].value: unclosed")
        );
    }
}
