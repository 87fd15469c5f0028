package dedupweb

import (
	"bytes"
	"embed"
	"html/template"
	"net/http"
	"net/url"
	"strings"
)

//go:embed templates/*.html
var templateFS embed.FS

// pages are the parsed templates, each with the layout.
var pages = func() map[string]*template.Template {
	funcs := template.FuncMap{
		"lockURL": func(root, key string) string { return root + "/lock?" + url.Values{"key": {key}}.Encode() },
		"locksURL": func(root, queue, typ, state string) string {
			q := url.Values{}
			for k, v := range map[string]string{"queue": queue, "type": typ, "state": state} {
				if v != "" {
					q.Set(k, v)
				}
			}
			if len(q) == 0 {
				return root + "/locks"
			}
			return root + "/locks?" + q.Encode()
		},
		"taskURL": func(asynqmon, queue, id string) string {
			if asynqmon == "" || id == "" {
				return ""
			}
			return asynqmon + "/queues/" + url.PathEscape(queue) + "/tasks/" + url.PathEscape(id)
		},
		"queueURL": func(asynqmon, queue string) string {
			if asynqmon == "" {
				return ""
			}
			return asynqmon + "/queues/" + url.PathEscape(queue)
		},
		"or": func(s, alt string) string {
			if s == "" {
				return alt
			}
			return s
		},
		"join": strings.Join,
	}
	layout := template.Must(template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html"))
	out := map[string]*template.Template{}
	for _, name := range []string{"overview", "locks", "lock", "search", "doctor", "confirm", "fix", "result", "error"} {
		out[name] = template.Must(template.Must(layout.Clone()).ParseFS(templateFS, "templates/"+name+".html"))
	}
	return out
}()

// render writes a page; a template error becomes a 500.
func (h *Handler) render(w http.ResponseWriter, status int, name string, data any) error {
	var b bytes.Buffer
	if err := pages[name].ExecuteTemplate(&b, "layout.html", data); err != nil {
		return err
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(b.Bytes()) // a failed write is a client gone: nothing to tell it
	return nil
}

// errorView is an error page.
type errorView struct {
	base
	Status int
	Msg    string
}

// fail renders an error page.
func (h *Handler) fail(w http.ResponseWriter, r *http.Request, status int, msg string) {
	v := errorView{base: h.base(http.StatusText(status)), Status: status, Msg: msg}
	if err := h.render(w, status, "error", v); err != nil {
		http.Error(w, msg, status)
	}
}
