//! The `InferenceRuntime` `args`/`env` templates: one parser, used by the admission webhook to
//! check a runtime and by the controller to render the backend.
//!
//! A template is Go `text/template` text whose actions are exactly the three field references
//! the public Hearth API defines: `{{ .Model.Path }}`, `{{ .Service.Name }}` and
//! `{{ .Service.Namespace }}`. Anything else is an error naming the field, never an empty string:
//! no pipelines, functions, variables or comments.
//!
//! Go's syntax is followed where it applies:
//! - spaces inside the braces are optional (`{{.Model.Path}}`); space is Go's: space, tab, CR, LF;
//! - trim markers: `{{- ` trims the white space (space, tab, CR, LF) immediately before the
//!   action, ` -}}` the white space immediately after it (`"--model= {{- .Model.Path }}"`
//!   renders `--model=<path>`). As in Go, a marker needs the space on its inner side:
//!   `{{-.Model.Path}}` is not a trim marker (Go reads `-.Model...` as a bad number), so it is
//!   an error;
//! - the first `}}` closes an action; a `}}` outside an action is plain text; a `{{` with no
//!   `}}` after it is an error.

use std::fmt;

/// The field references a template may use, as written inside the braces.
pub const FIELDS: [&str; 3] = [".Model.Path", ".Service.Name", ".Service.Namespace"];

/// One of the three field references.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    /// `.Model.Path`: what the engine loads.
    ModelPath,
    /// `.Service.Name`: the `LLMService` name.
    ServiceName,
    /// `.Service.Namespace`: the `LLMService` namespace.
    ServiceNamespace,
}

impl Field {
    /// The reference as written, `.Model.Path`.
    pub fn reference(self) -> &'static str {
        match self {
            Field::ModelPath => FIELDS[0],
            Field::ServiceName => FIELDS[1],
            Field::ServiceNamespace => FIELDS[2],
        }
    }

    fn from_reference(s: &str) -> Option<Self> {
        match s {
            ".Model.Path" => Some(Field::ModelPath),
            ".Service.Name" => Some(Field::ServiceName),
            ".Service.Namespace" => Some(Field::ServiceNamespace),
            _ => None,
        }
    }
}

/// The values a template can reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateValues<'a> {
    /// `.Model.Path`: what the engine loads.
    pub model_path: &'a str,
    /// `.Service.Name`: the `LLMService` name.
    pub service_name: &'a str,
    /// `.Service.Namespace`: the `LLMService` namespace.
    pub service_namespace: &'a str,
}

impl TemplateValues<'_> {
    fn get(&self, field: Field) -> &str {
        match field {
            Field::ModelPath => self.model_path,
            Field::ServiceName => self.service_name,
            Field::ServiceNamespace => self.service_namespace,
        }
    }
}

/// Why a template did not parse. The message names the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateError {
    /// `{{` without a closing `}}`.
    Unclosed {
        /// Where the template came from, e.g. `spec.container.args[0]`.
        field: String,
        /// The template text.
        text: String,
    },
    /// An action other than the three field references.
    Unknown {
        /// Where the template came from.
        field: String,
        /// The action as written, without its braces, trim markers and surrounding space.
        reference: String,
    },
}

impl TemplateError {
    /// The field the template came from.
    pub fn field(&self) -> &str {
        match self {
            TemplateError::Unclosed { field, .. } | TemplateError::Unknown { field, .. } => field,
        }
    }

    /// What is wrong and how to fix it, without the field.
    pub fn problem(&self) -> String {
        match self {
            TemplateError::Unclosed { text, .. } => format!(
                "unclosed \"{{{{\" in {text:?}: the action has no closing \"}}}}\" (it opens \"{{{{\" without a closing \"}}}}\"); close it"
            ),
            TemplateError::Unknown { reference, .. } => {
                let hint = if reference.is_empty() {
                    " (the action is empty)"
                } else if reference.starts_with('-') || reference.ends_with('-') {
                    " (a trim marker needs white space on its inner side, as in {{- .Model.Path -}})"
                } else {
                    ""
                };
                format!(
                    "unknown template reference {{{{ {reference} }}}}{hint}: use {{{{ .Model.Path }}}}, {{{{ .Service.Name }}}} or {{{{ .Service.Namespace }}}}"
                )
            }
        }
    }
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field(), self.problem())
    }
}

impl std::error::Error for TemplateError {}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece<'a> {
    Text(&'a str),
    Field(Field),
}

/// A parsed template: text (already trimmed by the trim markers) and field references.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Template<'a> {
    pieces: Vec<Piece<'a>>,
}

/// Go's white space in actions and for trim markers (`isSpace` of text/template/parse).
fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\r' | '\n')
}

/// Parses `text`; `field` names its place (`spec.container.args[0]`) for errors.
pub fn parse<'a>(text: &'a str, field: &str) -> Result<Template<'a>, TemplateError> {
    let mut pieces = Vec::new();
    let mut rest = text;
    // Set by a ` -}}`: the white space that starts the next text is dropped.
    let mut trim_next = false;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or_else(|| TemplateError::Unclosed {
            field: field.to_owned(),
            text: text.to_owned(),
        })?;
        let mut inner = &after[..end];
        let mut before = &rest[..start];
        if trim_next {
            before = before.trim_start_matches(is_space);
        }
        // `{{- `: a dash, then white space; the marker is both (as Go's lexer reads it), so
        // that space cannot also serve a right marker (`{{- -}}` is an error, as in Go).
        if let Some(stripped) = inner.strip_prefix('-')
            && stripped.starts_with(is_space)
        {
            inner = &stripped[1..];
            before = before.trim_end_matches(is_space);
        }
        // ` -}}`: white space, then a dash.
        trim_next = false;
        if let Some(stripped) = inner.strip_suffix('-')
            && stripped.ends_with(is_space)
        {
            inner = stripped;
            trim_next = true;
        }
        if !before.is_empty() {
            pieces.push(Piece::Text(before));
        }
        let reference = inner.trim_matches(is_space);
        let Some(f) = Field::from_reference(reference) else {
            return Err(TemplateError::Unknown {
                field: field.to_owned(),
                reference: reference.to_owned(),
            });
        };
        pieces.push(Piece::Field(f));
        rest = &after[end + 2..];
    }
    if trim_next {
        rest = rest.trim_start_matches(is_space);
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest));
    }
    Ok(Template { pieces })
}

impl Template<'_> {
    /// The text with every reference replaced by its value.
    pub fn render(&self, values: &TemplateValues<'_>) -> String {
        let mut out = String::new();
        for p in &self.pieces {
            out.push_str(match p {
                Piece::Text(t) => t,
                Piece::Field(f) => values.get(*f),
            });
        }
        out
    }

    /// The references used, in order.
    pub fn fields(&self) -> impl Iterator<Item = Field> + '_ {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Field(f) => Some(*f),
            Piece::Text(_) => None,
        })
    }
}

/// Parses and renders one template string; `field` names its place for errors.
pub fn render(
    text: &str,
    values: &TemplateValues<'_>,
    field: &str,
) -> Result<String, TemplateError> {
    Ok(parse(text, field)?.render(values))
}

/// The template strings of a runtime with their field paths: `spec.container.args[i]` and the
/// literal `spec.container.env[i].value`s.
pub fn runtime_templates(
    spec: &crate::InferenceRuntimeSpec,
) -> impl Iterator<Item = (String, &str)> + '_ {
    let c = &spec.container;
    let args = c
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("spec.container.args[{i}]"), a.as_str()));
    let env = c.env.iter().enumerate().filter_map(|(i, e)| {
        e.value
            .as_deref()
            .map(|v| (format!("spec.container.env[{i}].value"), v))
    });
    args.chain(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const V: TemplateValues<'static> = TemplateValues {
        model_path: "Qwen/Qwen2.5-7B-Instruct",
        service_name: "qwen",
        service_namespace: "ml",
    };

    #[rstest]
    #[case("{{ .Model.Path }}", "Qwen/Qwen2.5-7B-Instruct")]
    #[case("--served-model-name={{ .Service.Name }}", "--served-model-name=qwen")]
    #[case("--model={{.Model.Path}}", "--model=Qwen/Qwen2.5-7B-Instruct")]
    #[case("{{ .Service.Name }}.{{ .Service.Namespace }}", "qwen.ml")]
    #[case("{{\t.Service.Name\n}}", "qwen")]
    #[case("--port=8000", "--port=8000")]
    #[case("", "")]
    #[case("a }} b", "a }} b")]
    // Trim markers trim the adjacent white space, as in Go.
    #[case("{{- .Service.Name -}}", "qwen")]
    #[case("  {{- .Service.Name -}}  ", "qwen")]
    #[case("--name= \t{{- .Service.Name }} x", "--name=qwen x")]
    #[case("--name= {{ .Service.Name -}} \n x", "--name= qwenx")]
    #[case("a {{- .Service.Name -}} . {{- .Service.Namespace -}} b", "aqwen.mlb")]
    #[case("a {{- .Service.Name -}}   {{- .Service.Namespace }}", "aqwenml")]
    #[case("{{-\t.Service.Name\n-}}", "qwen")]
    // Only white space is trimmed, and only next to a marker.
    #[case("x-{{- .Service.Name }}", "x-qwen")]
    #[case("x {{ .Service.Name }} y", "x qwen y")]
    fn renders(#[case] text: &str, #[case] want: &str) {
        assert_eq!(render(text, &V, "a").unwrap(), want, "{text:?}");
    }

    #[rstest]
    #[case("{{ .Model.Name }}", ".Model.Name", "")]
    #[case("{{ }}", "", "empty")]
    #[case("{{- -}}", "-", "trim marker")]
    #[case("{{-.Service.Name}}", "-.Service.Name", "trim marker")]
    #[case("{{.Service.Name-}}", ".Service.Name-", "trim marker")]
    #[case("{{ .Service.Name | upper }}", ".Service.Name | upper", "")]
    #[case("{{/* note */}}", "/* note */", "")]
    #[case("{{ .Model.Path }}{{ .Secret }}", ".Secret", "")]
    fn unknown_references_are_errors(
        #[case] text: &str,
        #[case] reference: &str,
        #[case] hint: &str,
    ) {
        let err = parse(text, "spec.container.args[2]").unwrap_err();
        assert_eq!(
            err,
            TemplateError::Unknown {
                field: "spec.container.args[2]".into(),
                reference: reference.into()
            }
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with("spec.container.args[2]: unknown template reference {{ "),
            "{msg}"
        );
        assert!(msg.contains("use {{ .Model.Path }}"), "{msg}");
        assert!(msg.contains(hint), "{msg}");
    }

    #[rstest]
    #[case("--x={{ .Model.Path")]
    #[case("{{")]
    #[case("{{ .Model.Path }} {{")]
    fn unclosed_is_an_error(#[case] text: &str) {
        let err = parse(text, "spec.container.env[0].value").unwrap_err();
        assert!(matches!(err, TemplateError::Unclosed { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.starts_with("spec.container.env[0].value: unclosed"),
            "{msg}"
        );
        assert!(msg.contains("without a closing"), "{msg}");
    }

    #[test]
    fn fields_in_order() {
        let t = parse("{{ .Service.Name }}/{{ .Model.Path }}", "a").unwrap();
        assert_eq!(
            t.fields().collect::<Vec<_>>(),
            [Field::ServiceName, Field::ModelPath]
        );
        assert_eq!(Field::ServiceNamespace.reference(), ".Service.Namespace");
    }
}
