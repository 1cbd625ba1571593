//! The runtime `args`/`env` templates: the parser of `hearth_crds::template`, which the admission
//! webhook checks runtimes with, so what it admits is what renders here. Go `text/template`
//! field references, exactly the three the public Hearth API defines (`{{ .Model.Path }}`,
//! `{{ .Service.Name }}`, `{{ .Service.Namespace }}`), with Go's trim markers (`{{- ` and ` -}}`
//! trim the adjacent white space). Anything else is an error naming the field.

pub use hearth_crds::template::{TemplateError, TemplateValues, parse, render};
