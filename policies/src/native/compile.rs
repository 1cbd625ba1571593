//! Compiling a parsed expression to the native evaluator's program, or `None` when it uses
//! something the native evaluator does not implement.

use kube_cel::cel::common::ast::{CallExpr, EntryExpr, Expr, IdedExpr, LiteralValue, operators};

use crate::compile::ROOT_VARIABLES;

#[derive(Clone, Copy, Debug)]
pub(super) enum BinOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    In,
    Add,
    Sub,
    Mul,
    Div,
    Mod,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Func {
    Size,
    Contains,
    StartsWith,
    EndsWith,
    String,
    Int,
    ListsRange,
    EscapeKey,
    Greatest,
    Least,
    Join,
    LowerAscii,
    UpperAscii,
    Duration,
    GetSeconds,
    Quantity,
    CompareTo,
    IsLessThan,
    IsGreaterThan,
}

#[derive(Debug)]
pub(super) enum Lit {
    Null,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Double(f64),
    Str(Box<str>),
}

#[derive(Debug)]
pub(super) enum Node {
    Lit(Lit),
    /// `object`, `oldObject`, `request`, `namespaceObject`, `params`, `service`, `settings`.
    Root(usize),
    /// A policy variable, by declaration index.
    Var(usize),
    /// A comprehension variable, by stack slot.
    Local(usize),
    Select(Box<Node>, Box<str>),
    Has(Box<Node>, Box<str>),
    Index(Box<Node>, Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Not(Box<Node>),
    NotStrictlyFalse(Box<Node>),
    Cond(Box<(Node, Node, Node)>),
    Bin(BinOp, Box<Node>, Box<Node>),
    Neg(Box<Node>),
    /// `@result + [x]` in a macro's step: appends to the accumulator in place.
    Append(usize, Box<Node>),
    List(Vec<Node>),
    Map(Vec<(Node, Node)>),
    Comp(Box<Comp>),
    Call(Func, Vec<Node>),
    Matches(Box<Node>, regex::Regex),
    /// `matches` with a pattern computed at run time.
    MatchesDynamic(Box<Node>, Box<Node>),
    Foreign(Box<Foreign>),
}

#[derive(Debug)]
pub(super) struct Comp {
    pub(super) range: Node,
    pub(super) init: Node,
    pub(super) cond: Node,
    pub(super) step: Node,
    pub(super) result: Node,
    /// Slot of the iteration variable; the accumulator is the next one.
    pub(super) slot: usize,
}

/// A library call the interpreter evaluates: the guarded call over bound arguments.
#[derive(Debug)]
pub(super) struct Foreign {
    pub(super) expr: IdedExpr,
    pub(super) names: Vec<String>,
    pub(super) args: Vec<Node>,
}

/// A compiled native program for one expression.
#[derive(Debug)]
pub(crate) struct Program {
    pub(super) root: Node,
    /// Bit `i` is set when the program reads root variable `i` (see [`root_index`]).
    pub(crate) roots: u8,
}

/// The bit of `request` in [`Program::roots`].
pub(crate) const REQUEST_ROOT: u8 = 1 << 2;

/// Index of a root variable in [`Roots`].
pub(super) fn root_index(name: &str) -> Option<usize> {
    ROOT_VARIABLES
        .iter()
        .filter(|n| **n != "variables")
        .position(|n| *n == name)
}

/// Number of root variables (all of [`ROOT_VARIABLES`] but `variables`).
pub(crate) const ROOTS: usize = 7;

/// Compiles a parsed (unguarded) expression, or `None` when it uses something this evaluator
/// does not implement (optional syntax, bytes, non-string map keys); the interpreter then
/// evaluates it. `declared` are the policy variables in declaration order.
pub(crate) fn compile(e: &IdedExpr, declared: &[String], bindings: &[String]) -> Option<Program> {
    let mut c = Compiler {
        declared,
        // Bindings of a standalone expression occupy the first local slots.
        scope: bindings.to_vec(),
        roots: 0,
    };
    let root = c.node(e)?;
    Some(Program {
        root,
        roots: c.roots,
    })
}

pub(super) struct Compiler<'d> {
    pub(super) declared: &'d [String],
    pub(super) scope: Vec<String>,
    pub(super) roots: u8,
}

impl Compiler<'_> {
    pub(super) fn local(&self, name: &str) -> Option<usize> {
        self.scope.iter().rposition(|s| s == name)
    }

    pub(super) fn boxed(&mut self, e: &IdedExpr) -> Option<Box<Node>> {
        self.node(e).map(Box::new)
    }

    pub(super) fn node(&mut self, e: &IdedExpr) -> Option<Node> {
        Some(match &e.expr {
            Expr::Literal(l) => Node::Lit(match l {
                LiteralValue::Null => Lit::Null,
                LiteralValue::Boolean(b) => Lit::Bool(*b.inner()),
                LiteralValue::Int(i) => Lit::Int(*i.inner()),
                LiteralValue::UInt(u) => Lit::UInt(*u.inner()),
                LiteralValue::Double(d) => Lit::Double(*d.inner()),
                LiteralValue::String(s) => Lit::Str(s.inner().into()),
                LiteralValue::Bytes(_) => return None,
            }),
            Expr::Ident(name) => match self.local(name) {
                Some(slot) => Node::Local(slot),
                None => {
                    let i = root_index(name)?;
                    self.roots |= 1 << i;
                    Node::Root(i)
                }
            },
            Expr::Select(s) => {
                if let Expr::Ident(root) = &s.operand.expr
                    && root == "variables"
                    && self.local(root).is_none()
                {
                    if s.test {
                        return None;
                    }
                    return Some(Node::Var(self.declared.iter().position(|d| *d == s.field)?));
                }
                let operand = self.boxed(&s.operand)?;
                let field = s.field.as_str().into();
                if s.test {
                    Node::Has(operand, field)
                } else {
                    Node::Select(operand, field)
                }
            }
            Expr::Call(call) => self.call(call)?,
            Expr::List(l) => {
                if !l.optional_indices.is_empty() {
                    return None;
                }
                Node::List(
                    l.elements
                        .iter()
                        .map(|x| self.node(x))
                        .collect::<Option<_>>()?,
                )
            }
            Expr::Map(m) => {
                let mut entries = Vec::with_capacity(m.entries.len());
                for en in &m.entries {
                    let EntryExpr::MapEntry(me) = &en.expr else {
                        return None;
                    };
                    if me.optional {
                        return None;
                    }
                    entries.push((self.node(&me.key)?, self.node(&me.value)?));
                }
                Node::Map(entries)
            }
            // `JSONPatch{...}` and `Object{...}` build maps, as the interpreter's rewrite does.
            Expr::Struct(s) => {
                let mut entries = Vec::with_capacity(s.entries.len());
                for en in &s.entries {
                    let EntryExpr::StructField(f) = &en.expr else {
                        return None;
                    };
                    if f.optional {
                        return None;
                    }
                    entries.push((
                        Node::Lit(Lit::Str(f.field.as_str().into())),
                        self.node(&f.value)?,
                    ));
                }
                Node::Map(entries)
            }
            Expr::Comprehension(c) => {
                if c.iter_var2.is_some() {
                    return None;
                }
                let range = self.node(&c.iter_range)?;
                let init = self.node(&c.accu_init)?;
                let slot = self.scope.len();
                self.scope.push(c.iter_var.clone());
                self.scope.push(c.accu_var.clone());
                let body = (|| {
                    Some((
                        self.node(&c.loop_cond)?,
                        self.node(&c.loop_step)?,
                        self.node(&c.result)?,
                    ))
                })();
                self.scope.truncate(slot);
                let (cond, step, result) = body?;
                Node::Comp(Box::new(Comp {
                    range,
                    init,
                    cond,
                    step,
                    result,
                    slot,
                }))
            }
            Expr::Unspecified => return None,
        })
    }

    pub(super) fn call(&mut self, call: &CallExpr) -> Option<Node> {
        let name = call.func_name.as_str();
        let args = &call.args;
        let two = |c: &mut Self| Some((c.boxed(&args[0])?, c.boxed(&args[1])?));
        match (name, args.len(), call.target.is_some()) {
            (operators::CONDITIONAL, 3, false) => {
                return Some(Node::Cond(Box::new((
                    self.node(&args[0])?,
                    self.node(&args[1])?,
                    self.node(&args[2])?,
                ))));
            }
            (operators::LOGICAL_AND, 2, false) => {
                let (a, b) = two(self)?;
                return Some(Node::And(a, b));
            }
            (operators::LOGICAL_OR, 2, false) => {
                let (a, b) = two(self)?;
                return Some(Node::Or(a, b));
            }
            (operators::LOGICAL_NOT, 1, false) => return Some(Node::Not(self.boxed(&args[0])?)),
            (operators::NOT_STRICTLY_FALSE, 1, false) => {
                return Some(Node::NotStrictlyFalse(self.boxed(&args[0])?));
            }
            (operators::NEGATE, 1, false) => return Some(Node::Neg(self.boxed(&args[0])?)),
            (operators::INDEX, 2, false) => {
                let (a, b) = two(self)?;
                return Some(Node::Index(a, b));
            }
            (operators::ADD, 2, false) => {
                if let Expr::Ident(acc) = &args[0].expr
                    && acc.starts_with('@')
                    && let Some(slot) = self.local(acc)
                {
                    return Some(Node::Append(slot, self.boxed(&args[1])?));
                }
            }
            (operators::OPT_INDEX | operators::OPT_SELECT, _, _) => return None,
            _ => {}
        }
        let op = match name {
            operators::EQUALS => Some(BinOp::Eq),
            operators::NOT_EQUALS => Some(BinOp::Ne),
            operators::LESS => Some(BinOp::Lt),
            operators::LESS_EQUALS => Some(BinOp::Le),
            operators::GREATER => Some(BinOp::Gt),
            operators::GREATER_EQUALS => Some(BinOp::Ge),
            operators::IN => Some(BinOp::In),
            operators::ADD => Some(BinOp::Add),
            operators::SUBSTRACT => Some(BinOp::Sub),
            operators::MULTIPLY => Some(BinOp::Mul),
            operators::DIVIDE => Some(BinOp::Div),
            operators::MODULO => Some(BinOp::Mod),
            _ => None,
        };
        if let Some(op) = op
            && args.len() == 2
            && call.target.is_none()
        {
            let (a, b) = two(self)?;
            return Some(Node::Bin(op, a, b));
        }
        // `ns.fn(...)` parses as a call of `fn` on the identifier `ns`.
        let namespace = match call.target.as_deref().map(|t| &t.expr) {
            Some(Expr::Ident(ns)) if self.local(ns).is_none() && root_index(ns).is_none() => {
                Some(ns.as_str())
            }
            _ => None,
        };
        let qualified = namespace.map(|ns| format!("{ns}.{name}"));
        let full = qualified.as_deref().unwrap_or(name);
        let target = if namespace.is_some() {
            None
        } else {
            call.target.as_deref()
        };
        let func = match (full, target.is_some(), args.len()) {
            ("size", false, 1) | ("size", true, 0) => Some(Func::Size),
            ("contains", true, 1) => Some(Func::Contains),
            ("startsWith", true, 1) => Some(Func::StartsWith),
            ("endsWith", true, 1) => Some(Func::EndsWith),
            ("string", false, 1) => Some(Func::String),
            ("int", false, 1) => Some(Func::Int),
            ("lists.range", false, 1) => Some(Func::ListsRange),
            ("jsonpatch.escapeKey", false, 1) => Some(Func::EscapeKey),
            ("math.greatest", false, _) => Some(Func::Greatest),
            ("math.least", false, _) => Some(Func::Least),
            ("join", true, 0 | 1) => Some(Func::Join),
            ("lowerAscii", true, 0) => Some(Func::LowerAscii),
            ("upperAscii", true, 0) => Some(Func::UpperAscii),
            ("duration", false, 1) => Some(Func::Duration),
            ("getSeconds", true, 0) => Some(Func::GetSeconds),
            ("quantity", false, 1) => Some(Func::Quantity),
            ("compareTo", true, 1) => Some(Func::CompareTo),
            ("isLessThan", true, 1) => Some(Func::IsLessThan),
            ("isGreaterThan", true, 1) => Some(Func::IsGreaterThan),
            _ => None,
        };
        let mut operands = Vec::with_capacity(args.len() + 1);
        if let Some(t) = target {
            operands.push(self.node(t)?);
        }
        for a in args {
            operands.push(self.node(a)?);
        }
        if let Some(f) = func {
            return Some(Node::Call(f, operands));
        }
        if full == "matches" && target.is_some() && args.len() == 1 {
            let mut operands = operands.into_iter();
            let target = Box::new(operands.next()?);
            return Some(match &args[0].expr {
                Expr::Literal(LiteralValue::String(p)) => {
                    Node::Matches(target, crate::compile::regex_limited(p.inner()).ok()?)
                }
                _ => Node::MatchesDynamic(target, Box::new(operands.next()?)),
            });
        }
        // Anything else the interpreter knows: a foreign call over bound arguments, with the
        // interpreter's own guards spliced in.
        let names: Vec<String> = (0..operands.len())
            .map(|i| format!("__hearth_arg{i}"))
            .collect();
        let ident = |n: &String| IdedExpr {
            id: 0,
            expr: Expr::Ident(n.clone()),
        };
        let mut bound = names.iter().map(ident);
        let new_target = match (namespace, target) {
            (Some(ns), _) => Some(Box::new(IdedExpr {
                id: 0,
                expr: Expr::Ident(ns.to_owned()),
            })),
            (None, Some(_)) => bound.next().map(Box::new),
            (None, None) => None,
        };
        let mut expr = IdedExpr {
            id: 0,
            expr: Expr::Call(CallExpr {
                func_name: name.to_owned(),
                target: new_target,
                args: bound.collect(),
            }),
        };
        crate::compile::rewrite(&mut expr);
        Some(Node::Foreign(Box::new(Foreign {
            expr,
            names,
            args: operands,
        })))
    }
}
